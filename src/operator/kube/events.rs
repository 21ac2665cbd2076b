//! A Kubernetes Event for every membership and hook action (added learner, promoted, removed,
//! hook added or released), on the Machine it concerns, so `kubectl describe machine` and
//! `kubectl get events` tell what the operator did and why it failed.
//!
//! Events are reports, not state: one that cannot be published is logged and dropped, and never
//! holds an action back.
//!
//! A failure is a `Warning` Event only once it persists: the operator retries a failed action
//! with backoff, and etcd refuses a membership change for a few seconds after another one
//! ("unhealthy cluster", "leader changed") as a matter of course. [`Streaks`] follows each
//! action's run of failures: while it is younger than `persist_after` a failure is a log line;
//! the first failure past it is one Warning (a run warns once); a success ends the run, and a
//! run that ended without a Warning is a transient failure, counted in
//! `etcd_warden_operator_transient_failures_total{action}` and noted on the success's Normal
//! Event ("after N failed attempts").

use std::collections::HashMap;
use std::time::Duration;

use ::kube::runtime::events::{Event, EventType, Recorder};
use k8s_openapi::api::core::v1::ObjectReference;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::operator::quorum::execute::ActionRecord;
use crate::operator::quorum::plan::Action;

/// Longest note Kubernetes accepts (1 kB).
const NOTE_MAX: usize = 1024;

/// The Event for one recorded action: `Normal` with a past-tense reason when it succeeded,
/// `Warning` with `<Action>Failed` when it did not.
pub fn event_for(rec: &ActionRecord) -> Event {
    let (action, done) = match &rec.action {
        Action::AddHook { .. } => ("AddDeletionHook", "DeletionHookAdded"),
        Action::ReleaseHook { .. } => ("ReleaseDeletionHook", "DeletionHookReleased"),
        Action::AddLearner { .. } => ("AddLearner", "LearnerAdded"),
        Action::StartMember { .. } => ("StartMember", "MemberStarted"),
        Action::Promote { .. } => ("PromoteLearner", "LearnerPromoted"),
        Action::RemoveMember { .. } => ("RemoveMember", "MemberRemoved"),
    };
    let (type_, reason, mut note) = match &rec.error {
        None => (EventType::Normal, done.to_owned(), rec.text.clone()),
        Some(e) => (
            EventType::Warning,
            format!("{action}Failed"),
            format!("{}: {e}", rec.text),
        ),
    };
    cut(&mut note);
    Event {
        type_,
        reason,
        note: Some(note),
        action: action.to_owned(),
        secondary: None,
    }
}

/// One action's run of failures.
#[derive(Debug, Clone)]
struct Streak {
    since: chrono::DateTime<chrono::Utc>,
    failures: u32,
    warned: bool,
}

/// What to do with one action record.
pub struct Verdict {
    /// The Event to publish, if any.
    pub event: Option<Event>,
    /// A run of this many failures ended in success without a Warning: a transient failure.
    pub transient: Option<u32>,
}

/// The runs of failures of every action, deciding which failures are Warnings (see the module
/// doc). Pure: the time is the record's.
#[derive(Debug)]
pub struct Streaks {
    persist_after: Duration,
    open: HashMap<String, Streak>,
}

impl Streaks {
    /// Failures become a Warning once their run is `persist_after` old.
    pub fn new(persist_after: Duration) -> Streaks {
        Streaks {
            persist_after,
            open: HashMap::new(),
        }
    }

    /// The verdict on `rec`, the run it belongs to updated.
    pub fn record(&mut self, rec: &ActionRecord) -> Verdict {
        // The same action again: same kind, machine and member (the Debug form carries them).
        let key = format!("{:?}", rec.action);
        let mut ev = event_for(rec);
        match &rec.error {
            None => {
                let ended = self.open.remove(&key);
                let transient = ended.as_ref().filter(|s| !s.warned).map(|s| s.failures);
                if let (Some(s), Some(note)) = (&ended, ev.note.as_mut()) {
                    note.push_str(&format!(" (after {} failed attempts)", s.failures));
                }
                Verdict {
                    event: Some(ev),
                    transient,
                }
            }
            Some(_) => {
                let s = self.open.entry(key).or_insert(Streak {
                    since: rec.at,
                    failures: 0,
                    warned: false,
                });
                s.failures += 1;
                let age = (rec.at - s.since).to_std().unwrap_or_default();
                if s.warned || age < self.persist_after {
                    return Verdict {
                        event: None,
                        transient: None,
                    };
                }
                s.warned = true;
                if let Some(note) = ev.note.as_mut() {
                    note.insert_str(
                        0,
                        &format!("failing for {}s, {} attempts: ", age.as_secs(), s.failures),
                    );
                    cut(note);
                }
                Verdict {
                    event: Some(ev),
                    transient: None,
                }
            }
        }
    }
}

/// Label of the transient-failure counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailureLabels {
    /// The action, as its Event names it (`AddLearner`, ...): six values.
    pub action: String,
}

/// Metrics of the Event publisher; cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct EventMetrics {
    transient: Family<FailureLabels, Counter>,
}

impl EventMetrics {
    /// Registers `etcd_warden_operator_transient_failures_total`.
    pub fn register(&self, registry: &mut Registry) {
        registry.sub_registry_with_prefix("etcd_warden").register(
            "operator_transient_failures",
            "Runs of failures of one action that ended in success before they became a Warning Event",
            self.transient.clone(),
        );
    }

    /// The count for `action` (for tests).
    pub fn transient(&self, action: &str) -> u64 {
        self.transient
            .get_or_create(&FailureLabels {
                action: action.to_owned(),
            })
            .get()
    }
}

/// Cuts `note` to what Kubernetes accepts, on a char boundary.
fn cut(note: &mut String) {
    if note.len() > NOTE_MAX {
        let mut at = NOTE_MAX;
        while !note.is_char_boundary(at) {
            at -= 1;
        }
        note.truncate(at);
    }
}

/// The object an action's Event is about: the Machine it names (in `machines_namespace`), or
/// `fallback` for an action that names none (a learner whose machine went away).
pub fn regarding(
    rec: &ActionRecord,
    machines_namespace: &str,
    fallback: &ObjectReference,
) -> ObjectReference {
    match rec.action.machine() {
        Some(name) => ObjectReference {
            api_version: Some("machine.openshift.io/v1beta1".into()),
            kind: Some("Machine".into()),
            name: Some(name.to_owned()),
            namespace: Some(machines_namespace.to_owned()),
            ..ObjectReference::default()
        },
        None => fallback.clone(),
    }
}

/// Publishes the Event [`Streaks`] decides on for every action `actions` carries, until
/// `cancel` or the operator is gone.
pub async fn publish(
    mut actions: broadcast::Receiver<ActionRecord>,
    recorder: Recorder,
    machines_namespace: String,
    fallback: ObjectReference,
    mut streaks: Streaks,
    metrics: EventMetrics,
    cancel: CancellationToken,
) {
    loop {
        let rec = tokio::select! {
            _ = cancel.cancelled() => return,
            r = actions.recv() => r,
        };
        match rec {
            Ok(rec) => {
                let verdict = streaks.record(&rec);
                if let Some(n) = verdict.transient {
                    let action = event_for(&rec).action;
                    info!(%action, failures = n, "{}: succeeded after {n} failed attempts", rec.text);
                    metrics
                        .transient
                        .get_or_create(&FailureLabels { action })
                        .inc();
                }
                let Some(ev) = verdict.event else {
                    info!(action = %rec.text, error = rec.error.as_deref().unwrap_or_default(), "action failed; retried before it is a Warning Event");
                    continue;
                };
                let about = regarding(&rec, &machines_namespace, &fallback);
                match recorder.publish(&ev, &about).await {
                    Ok(()) => debug!(reason = %ev.reason, "event published"),
                    Err(e) => warn!(reason = %ev.reason, error = %e, "publishing an event"),
                }
            }
            Err(broadcast::error::RecvError::Lagged(n)) => {
                warn!(missed = n, "events fell behind; some actions have no Event");
            }
            Err(broadcast::error::RecvError::Closed) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(action: Action, error: Option<&str>) -> ActionRecord {
        ActionRecord {
            text: action.to_string(),
            action,
            at: chrono::Utc::now(),
            error: error.map(String::from),
        }
    }

    #[test]
    fn a_success_is_normal_and_a_failure_a_warning() {
        let ok = event_for(&rec(
            Action::Promote {
                member_id: 0xab,
                machine: "cp-3".into(),
            },
            None,
        ));
        assert!(matches!(ok.type_, EventType::Normal));
        assert_eq!(ok.reason, "LearnerPromoted");
        assert_eq!(ok.action, "PromoteLearner");
        assert_eq!(
            ok.note.as_deref(),
            Some("promote learner ab on machine cp-3")
        );

        let failed = event_for(&rec(
            Action::AddHook {
                machine: "cp-1".into(),
            },
            Some("forbidden"),
        ));
        assert!(matches!(failed.type_, EventType::Warning));
        assert_eq!(failed.reason, "AddDeletionHookFailed");
        assert_eq!(
            failed.note.as_deref(),
            Some("add deletion hook to machine cp-1: forbidden")
        );
    }

    #[test]
    fn a_failure_retried_and_cleared_is_no_warning_but_one_that_persists_is_one() {
        let at = |ms: i64| chrono::DateTime::from_timestamp_millis(1_700_000_000_000 + ms).unwrap();
        let add = || Action::AddLearner {
            machine: "cp-3".into(),
            peer_url: "https://10.0.0.3:2380".into(),
        };
        let rec_at = |ms, error: Option<&str>| ActionRecord {
            at: at(ms),
            ..rec(add(), error)
        };
        let mut s = Streaks::new(Duration::from_secs(30));
        // Retried and cleared within half a second: no Warning, one transient failure.
        for ms in [0, 200] {
            let v = s.record(&rec_at(ms, Some("etcdserver: unhealthy cluster")));
            assert!(v.event.is_none() && v.transient.is_none());
        }
        let v = s.record(&rec_at(500, None));
        assert_eq!(v.transient, Some(2));
        let ev = v.event.unwrap();
        assert!(matches!(ev.type_, EventType::Normal));
        assert!(ev.note.unwrap().ends_with("(after 2 failed attempts)"));
        // A success with no failure before it: nothing transient.
        assert_eq!(s.record(&rec_at(600, None)).transient, None);
        // A run older than 30 s: one Warning, then quiet; its success is not transient.
        assert!(s.record(&rec_at(1_000, Some("down"))).event.is_none());
        assert!(s.record(&rec_at(20_000, Some("down"))).event.is_none());
        let w = s.record(&rec_at(31_000, Some("down"))).event.unwrap();
        assert!(matches!(w.type_, EventType::Warning));
        assert_eq!(w.reason, "AddLearnerFailed");
        assert!(w.note.unwrap().starts_with("failing for 30s, 3 attempts: "));
        assert!(s.record(&rec_at(40_000, Some("down"))).event.is_none());
        let v = s.record(&rec_at(41_000, None));
        assert_eq!(v.transient, None);
        assert!(v.event.is_some());
        // Another machine's action is another run.
        let other = ActionRecord {
            at: at(50_000),
            ..rec(
                Action::AddHook {
                    machine: "cp-1".into(),
                },
                Some("x"),
            )
        };
        assert!(s.record(&other).event.is_none());
    }

    #[test]
    fn the_note_is_cut_to_one_kilobyte_on_a_char_boundary() {
        let long = "é".repeat(700);
        let ev = event_for(&rec(
            Action::ReleaseHook {
                machine: "cp-1".into(),
            },
            Some(&long),
        ));
        let note = ev.note.unwrap();
        assert!(note.len() <= NOTE_MAX && note.len() > NOTE_MAX - 2);
    }

    #[test]
    fn an_action_without_a_machine_is_about_the_fallback() {
        let fallback = ObjectReference {
            kind: Some("ConfigMap".into()),
            name: Some("etcd-endpoints".into()),
            namespace: Some("openshift-etcd".into()),
            ..ObjectReference::default()
        };
        let r = rec(
            Action::AddLearner {
                machine: "cp-4".into(),
                peer_url: "https://10.0.0.4:2380".into(),
            },
            None,
        );
        let about = regarding(&r, "openshift-machine-api", &fallback);
        assert_eq!(about.kind.as_deref(), Some("Machine"));
        assert_eq!(about.name.as_deref(), Some("cp-4"));
        assert_eq!(about.namespace.as_deref(), Some("openshift-machine-api"));
        let r = rec(
            Action::RemoveMember {
                member_id: 7,
                name: String::new(),
                reason: crate::operator::quorum::plan::RemoveReason::DanglingLearner,
            },
            None,
        );
        assert_eq!(regarding(&r, "x", &fallback), fallback);
    }
}
