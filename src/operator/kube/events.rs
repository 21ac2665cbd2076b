//! A Kubernetes Event for every membership and hook action (added learner, promoted, removed,
//! hook added or released), on the Machine it concerns, so `kubectl describe machine` and
//! `kubectl get events` tell what the operator did and why it failed.
//!
//! Events are reports, not state: one that cannot be published is logged and dropped, and never
//! holds an action back.

use ::kube::runtime::events::{Event, EventType, Recorder};
use k8s_openapi::api::core::v1::ObjectReference;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::operator::execute::ActionRecord;
use crate::operator::plan::Action;

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
    if note.len() > NOTE_MAX {
        let mut cut = NOTE_MAX;
        while !note.is_char_boundary(cut) {
            cut -= 1;
        }
        note.truncate(cut);
    }
    Event {
        type_,
        reason,
        note: Some(note),
        action: action.to_owned(),
        secondary: None,
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

/// Publishes an Event for every action `actions` carries, until `cancel` or the operator is
/// gone.
pub async fn publish(
    mut actions: broadcast::Receiver<ActionRecord>,
    recorder: Recorder,
    machines_namespace: String,
    fallback: ObjectReference,
    cancel: CancellationToken,
) {
    loop {
        let rec = tokio::select! {
            _ = cancel.cancelled() => return,
            r = actions.recv() => r,
        };
        match rec {
            Ok(rec) => {
                let ev = event_for(&rec);
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
                reason: crate::operator::plan::RemoveReason::DanglingLearner,
            },
            None,
        );
        assert_eq!(regarding(&r, "x", &fallback), fallback);
    }
}
