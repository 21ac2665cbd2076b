//! Kubernetes Events from the sidecar (on its pod, or on the `EtcdSnapshot` a drill judged)
//! and from the Jobs (on their pod): snapshot failed and recovered, the hand-off's steps, the
//! owner record lost and found, defragmentation moving leadership, drills.
//!
//! The Events are derived from the status the snapshot actor and the ownership watchdog
//! already publish ([`actor_notices`], [`owner_notices`]: pure, from one status to the next),
//! so nothing on the safety path calls the API or waits for it: a notice is offered to a
//! bounded queue and dropped (counted, logged) when the queue is full. A watch channel keeps
//! only the newest status, so a step passed between two looks is still reported: the hand-off's
//! steps are judged by how far it got ([`progress`]), each threshold crossed once.
//!
//! Rate: per reason a bucket of [`BURST`] Events refilled one per [`REFILL`]; what the bucket
//! refuses is counted and said in the next Event of that reason ("3 more since ..."). The
//! recorder (kube-rs's) folds repeats of one Event into a series, as Kubernetes does.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::owner::protocol::{FinalOutcome, FinalStep, Retry, State};
use crate::owner::watchdog::WatchdogStatus;
use crate::snapshot::actor::{ActorStatus, DefragEvent};

/// Events of one reason published at once before the bucket limits them.
pub const BURST: u32 = 5;
/// One more Event of a reason per this long.
pub const REFILL: Duration = Duration::from_secs(60);
/// Longest note Kubernetes accepts.
const NOTE_MAX: usize = 1024;
/// Notices waiting for the publisher; more are dropped.
const QUEUE: usize = 64;

/// What an Event says, before it is about anything.
#[derive(Debug, Clone, PartialEq)]
pub struct Notice {
    /// Normal or Warning.
    pub warning: bool,
    /// CamelCase, as Kubernetes' own reasons.
    pub reason: &'static str,
    /// What was done (CamelCase).
    pub action: &'static str,
    /// In words.
    pub note: String,
    /// The object it is about, when not this pod (an `EtcdSnapshot`).
    pub regarding: Option<ObjectReference>,
}

impl Notice {
    fn normal(reason: &'static str, action: &'static str, note: String) -> Notice {
        Notice {
            warning: false,
            reason,
            action,
            note,
            regarding: None,
        }
    }

    fn warning(reason: &'static str, action: &'static str, note: String) -> Notice {
        Notice {
            warning: true,
            ..Notice::normal(reason, action, note)
        }
    }
}

/// The snapshot actor's Events from one status to the next: a failure after success
/// (`SnapshotFailed`), a success after failure (`SnapshotRecovered`), a defragmentation pass
/// that moved leadership (`LeadershipMoved`) or defragmented members (`Defragmented`).
pub fn actor_notices(prev: &ActorStatus, next: &ActorStatus) -> Vec<Notice> {
    let mut out = Vec::new();
    match (&prev.last_error, &next.last_error) {
        (None, Some(e)) => out.push(Notice::warning(
            "SnapshotFailed",
            "Snapshot",
            format!("snapshot failed: {e}"),
        )),
        (Some(e), None) => out.push(Notice::normal(
            "SnapshotRecovered",
            "Snapshot",
            format!("snapshots succeed again (the last failure: {e})"),
        )),
        _ => {}
    }
    if next.last_defrag != prev.last_defrag
        && let Some(report) = &next.last_defrag
    {
        for ev in &report.events {
            if let DefragEvent::MovedLeader { from, to } = ev {
                out.push(Notice::normal(
                    "LeadershipMoved",
                    "Defragment",
                    format!("leadership moved from member {from:x} to {to:x} before the leader's defragmentation"),
                ));
            }
        }
        if !report.defragmented.is_empty() {
            let members: Vec<String> = report
                .defragmented
                .iter()
                .map(|m| format!("{m:x}"))
                .collect();
            out.push(Notice::normal(
                "Defragmented",
                "Defragment",
                format!("defragmented members {}", members.join(", ")),
            ));
        }
    }
    out
}

/// How far a hand-off got: 0 killing, 1 killed (verified), 2 fenced, 3 final in the store.
pub fn progress(state: &State) -> Option<u8> {
    let State::Deactivated(step) = state else {
        return None;
    };
    Some(match step {
        FinalStep::Killing | FinalStep::KillRetry => 0,
        FinalStep::Settling
        | FinalStep::KillingAgain
        | FinalStep::KillAgainRetry
        | FinalStep::Fencing
        | FinalStep::Backoff(Retry::Fence) => 1,
        FinalStep::AwaitingEtcd
        | FinalStep::Checking
        | FinalStep::ReadingRevision
        | FinalStep::Claiming
        | FinalStep::FixingIntent
        | FinalStep::Waiting
        | FinalStep::Taking
        | FinalStep::Backoff(Retry::Check | Retry::Unsettled) => 2,
        FinalStep::Recording(_) | FinalStep::Done(_) => 3,
    })
}

/// The ownership watchdog's Events from one status to the next.
pub fn owner_notices(prev: &WatchdogStatus, next: &WatchdogStatus) -> Vec<Notice> {
    let mut out = Vec::new();
    let (was, is) = (prev.phase, next.phase);
    match (was, is) {
        (State::Starting, State::Active) => out.push(Notice::normal(
            "OwnershipConfirmed",
            "CheckOwner",
            format!("the owner record names this seed: etcd may serve ({})", next.reason),
        )),
        (State::Active, State::Suspended(_)) => out.push(Notice::warning(
            "OwnerRecordUnresolved",
            "CheckOwner",
            format!("the owner record cannot be resolved: etcd is unready and stopped until it resolves to this seed again ({})", next.reason),
        )),
        (State::Suspended(_), State::Active) => out.push(Notice::normal(
            "OwnerRecordResolved",
            "CheckOwner",
            "the owner record names this seed again: etcd may serve".to_owned(),
        )),
        _ => {}
    }
    // The final's name is published just after the step: a final is reported once it is known.
    let seen = |s: &WatchdogStatus| {
        progress(&s.phase).map(|p| {
            if p == 3 && s.final_snapshot.is_none() {
                2
            } else {
                p
            }
        })
    };
    let before = seen(prev);
    let Some(now) = seen(next) else {
        return out;
    };
    if before.is_none() {
        out.push(Notice::warning(
            "Deactivated",
            "HandOff",
            format!("this seed no longer owns etcd: unready, etcd is stopped, regular snapshots end ({})", next.reason),
        ));
    }
    let from = before.map_or(0, |b| b + 1);
    for step in from..=now {
        match step {
            1 => out.push(Notice::normal(
                "EtcdKilled",
                "HandOff",
                next.kill
                    .as_ref()
                    .map_or("etcd was killed and the kill verified".to_owned(), |k| {
                        format!("etcd was killed and the kill verified: {}", k.last)
                    }),
            )),
            2 => out.push(Notice::normal(
                "Fenced",
                "HandOff",
                "this member's fence marker is in the store: it takes no more writes".to_owned(),
            )),
            3 => {
                let name = next.final_snapshot.clone().unwrap_or_default();
                out.push(match is {
                    State::Deactivated(FinalStep::Done(FinalOutcome::FoundInStore))
                    | State::Deactivated(FinalStep::Recording(FinalOutcome::FoundInStore)) => {
                        Notice::normal(
                            "FinalSnapshotFound",
                            "HandOff",
                            format!("the hand-off's final snapshot is in the store (taken by another member or an earlier process): {name}"),
                        )
                    }
                    _ => Notice::normal(
                        "FinalSnapshotStored",
                        "HandOff",
                        format!("this sidecar took and stored the hand-off's final snapshot: {name}"),
                    ),
                });
            }
            _ => {}
        }
    }
    out
}

/// Per reason, a bucket of [`BURST`] refilled one per [`REFILL`]. Pure: the time is given.
#[derive(Debug, Default)]
pub struct Limiter {
    buckets: HashMap<&'static str, Bucket>,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: DateTime<Utc>,
    suppressed: u64,
    since: Option<DateTime<Utc>>,
}

impl Limiter {
    /// The notice to publish now (its note saying how many were held back before it), or
    /// `None` when its reason's bucket is empty.
    pub fn admit(&mut self, mut notice: Notice, now: DateTime<Utc>) -> Option<Notice> {
        let b = self.buckets.entry(notice.reason).or_insert(Bucket {
            tokens: f64::from(BURST),
            at: now,
            suppressed: 0,
            since: None,
        });
        let gained = (now - b.at).to_std().unwrap_or_default().as_secs_f64() / REFILL.as_secs_f64();
        b.tokens = (b.tokens + gained).min(f64::from(BURST));
        b.at = now;
        if b.tokens < 1.0 {
            b.suppressed += 1;
            b.since.get_or_insert(now);
            return None;
        }
        b.tokens -= 1.0;
        if b.suppressed > 0 {
            let since = b.since.take().unwrap_or(now);
            notice.note.push_str(&format!(
                " ({} more since {} not published: rate limit)",
                b.suppressed,
                since.format("%H:%M:%SZ")
            ));
            b.suppressed = 0;
        }
        Some(notice)
    }
}

/// Where notices go: a bounded queue to the publisher. Offering never waits.
#[derive(Clone, Debug)]
pub struct Notices {
    tx: Option<mpsc::Sender<Notice>>,
}

impl Notices {
    /// Notices that go nowhere (`kubernetes.events` off).
    pub fn off() -> Notices {
        Notices { tx: None }
    }

    /// Offers `notice`; a full queue drops it (logged).
    pub fn offer(&self, notice: Notice) {
        let Some(tx) = &self.tx else { return };
        if let Err(e) = tx.try_send(notice) {
            tracing::debug!(error = %e, "event dropped: the publisher is behind or gone");
        }
    }
}

/// A queue and its publisher: the publisher runs until `cancel`.
pub fn channel() -> (Notices, mpsc::Receiver<Notice>) {
    let (tx, rx) = mpsc::channel(QUEUE);
    (Notices { tx: Some(tx) }, rx)
}

/// This pod, as Events name it.
pub fn pod_reference(config: &crate::config::KubernetesConfig) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some(config.pod.clone()),
        namespace: Some(config.namespace.clone()),
        uid: config.pod_uid.clone(),
        ..ObjectReference::default()
    }
}

/// The recorder for `component` (`etcd-warden`, `etcd-warden-copy`, ...) in this pod.
pub fn recorder(
    client: kube::Client,
    component: &str,
    config: &crate::config::KubernetesConfig,
) -> Recorder {
    Recorder::new(
        client,
        Reporter {
            controller: component.to_owned(),
            instance: Some(config.pod.clone()),
        },
    )
}

/// Publishes one notice about `regarding` within `timeout`; a failure is logged.
pub async fn publish_one(
    recorder: &Recorder,
    notice: &Notice,
    regarding: &ObjectReference,
    timeout: Duration,
) -> bool {
    let mut note = notice.note.clone();
    if note.len() > NOTE_MAX {
        let mut at = NOTE_MAX;
        while !note.is_char_boundary(at) {
            at -= 1;
        }
        note.truncate(at);
    }
    let ev = Event {
        type_: if notice.warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: notice.reason.to_owned(),
        note: Some(note),
        action: notice.action.to_owned(),
        secondary: None,
    };
    let about = notice.regarding.as_ref().unwrap_or(regarding);
    match tokio::time::timeout(timeout, recorder.publish(&ev, about)).await {
        Ok(Ok(())) => true,
        Ok(Err(e)) => {
            tracing::warn!(reason = notice.reason, error = %e, "publishing an event");
            false
        }
        Err(_) => {
            tracing::warn!(reason = notice.reason, after = ?timeout, "publishing an event: no answer");
            false
        }
    }
}

/// Publishes what `rx` brings, rate-limited, until `cancel`.
pub async fn publish(
    mut rx: mpsc::Receiver<Notice>,
    recorder: Recorder,
    pod: ObjectReference,
    timeout: Duration,
    cancel: CancellationToken,
) {
    let mut limiter = Limiter::default();
    loop {
        let notice = tokio::select! {
            _ = cancel.cancelled() => return,
            n = rx.recv() => match n { Some(n) => n, None => return },
        };
        let Some(notice) = limiter.admit(notice, Utc::now()) else {
            continue;
        };
        publish_one(&recorder, &notice, &pod, timeout).await;
    }
}

/// Turns the actor's and the watchdog's statuses into notices until `cancel`.
pub async fn follow(
    mut actor: watch::Receiver<ActorStatus>,
    mut owner: Option<watch::Receiver<WatchdogStatus>>,
    notices: Notices,
    cancel: CancellationToken,
) {
    let mut last_actor = actor.borrow_and_update().clone();
    let mut last_owner = owner.as_mut().map(|o| o.borrow_and_update().clone());
    // Already Active when this starts (the watchdog is quick): confirmed all the same. Any other
    // state is reported from its next change (a restarted, handed-off sidecar does not tell its
    // hand-off again).
    if let Some(now) = &last_owner
        && now.phase == State::Active
    {
        let starting = WatchdogStatus {
            phase: State::Starting,
            ..now.clone()
        };
        for n in owner_notices(&starting, now) {
            notices.offer(n);
        }
    }
    loop {
        let owner_changed = async {
            match owner.as_mut() {
                Some(o) => o.changed().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            r = actor.changed() => {
                if r.is_err() { cancel.cancelled().await; return; }
                let next = actor.borrow_and_update().clone();
                for n in actor_notices(&last_actor, &next) { notices.offer(n); }
                last_actor = next;
            }
            r = owner_changed => {
                if r.is_err() { cancel.cancelled().await; return; }
                if let (Some(o), Some(last)) = (owner.as_mut(), last_owner.as_mut()) {
                    let next = o.borrow_and_update().clone();
                    for n in owner_notices(last, &next) { notices.offer(n); }
                    *last = next;
                }
            }
        }
    }
}

/// A Job's command, for its one Event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Job {
    /// `copy` (the migration's copy Job).
    Copy,
    /// `verify --restore` (the drill CronJob).
    Drill,
    /// `compact`.
    Compact,
    /// `restore`.
    Restore,
    /// `quorum-restore`.
    QuorumRestore,
}

impl Job {
    /// The notice for how the command ended.
    pub fn notice(self, outcome: Result<(), &str>) -> Notice {
        let (action, ok, failed, did) = match self {
            Job::Copy => ("Copy", "CopyCompleted", "CopyFailed", "copy"),
            Job::Drill => ("Drill", "DrillPassed", "DrillFailed", "restore drill"),
            Job::Compact => ("Compact", "CompactCompleted", "CompactFailed", "compaction"),
            Job::Restore => ("Restore", "RestoreCompleted", "RestoreFailed", "restore"),
            Job::QuorumRestore => (
                "QuorumRestore",
                "QuorumRestoreCompleted",
                "QuorumRestoreFailed",
                "quorum restore",
            ),
        };
        match outcome {
            Ok(()) => Notice::normal(ok, action, format!("{did} done")),
            Err(e) => Notice::warning(failed, action, format!("{did} failed: {e}")),
        }
    }

    /// Its recorder's name (`reportingController`).
    fn component(self) -> &'static str {
        match self {
            Job::Copy => "etcd-warden-copy",
            Job::Drill => "etcd-warden-drill",
            Job::Compact => "etcd-warden-compact",
            Job::Restore => "etcd-warden-restore",
            Job::QuorumRestore => "etcd-warden-quorum-restore",
        }
    }
}

/// With `[kubernetes]` (events on): one Event on the Job's pod saying how `job` ended,
/// published within `kubernetes.request_timeout`. Nothing the Job did waits for it, and a
/// failure to publish is logged, never the Job's failure.
pub async fn report_job(config: &crate::config::Config, job: Job, outcome: Result<(), &str>) {
    let Some(k) = config.kubernetes.as_ref().filter(|k| k.events) else {
        return;
    };
    let client = match crate::kube_client::client(k.kubeconfig.as_deref()).await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "no Event for this Job: the Kubernetes client");
            return;
        }
    };
    let recorder = recorder(client, job.component(), k);
    publish_one(
        &recorder,
        &job.notice(outcome),
        &pod_reference(k),
        k.request_timeout,
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::owner::protocol::KillStep;

    fn owner(phase: State) -> WatchdogStatus {
        WatchdogStatus {
            state: phase.name().into(),
            detail: phase.to_string(),
            reason: "why".into(),
            ready: phase == State::Active,
            last_check_at: None,
            last_check: None,
            last_success_at: None,
            consecutive_failures: 0,
            etcd_process: None,
            etcd_identified_by: None,
            member_id: None,
            kill: None,
            waiting_for: Vec::new(),
            final_snapshot: Some("Full-1.final".into()),
            last_error: None,
            phase,
        }
    }

    fn reasons(v: &[Notice]) -> Vec<&'static str> {
        v.iter().map(|n| n.reason).collect()
    }

    #[test]
    fn a_hand_off_is_reported_step_by_step_even_when_steps_are_skipped() {
        let active = owner(State::Active);
        let killing = owner(State::Deactivated(FinalStep::Killing));
        let fencing = owner(State::Deactivated(FinalStep::Fencing));
        let waiting = owner(State::Deactivated(FinalStep::Waiting));
        let done = owner(State::Deactivated(FinalStep::Done(FinalOutcome::Taken)));
        assert_eq!(reasons(&owner_notices(&active, &killing)), ["Deactivated"]);
        assert_eq!(reasons(&owner_notices(&killing, &fencing)), ["EtcdKilled"]);
        assert_eq!(reasons(&owner_notices(&fencing, &waiting)), ["Fenced"]);
        assert_eq!(
            reasons(&owner_notices(&waiting, &done)),
            ["FinalSnapshotStored"]
        );
        assert!(owner_notices(&done, &done).is_empty());
        assert!(owner_notices(&waiting, &waiting).is_empty(), "a step once");
        // Seen only at its end (the watch kept the newest status): every step, once, in order.
        assert_eq!(
            reasons(&owner_notices(&active, &done)),
            ["Deactivated", "EtcdKilled", "Fenced", "FinalSnapshotStored"]
        );
        let found = owner(State::Deactivated(FinalStep::Done(
            FinalOutcome::FoundInStore,
        )));
        assert_eq!(
            reasons(&owner_notices(&waiting, &found)),
            ["FinalSnapshotFound"]
        );
        // The final's name comes a moment after its step: reported once the name is known.
        let mut unnamed = done.clone();
        unnamed.final_snapshot = None;
        assert!(owner_notices(&waiting, &unnamed).is_empty());
        assert_eq!(
            reasons(&owner_notices(&unnamed, &done)),
            ["FinalSnapshotStored"]
        );
        assert!(
            owner_notices(&waiting, &done)[0]
                .note
                .ends_with("Full-1.final")
        );
        // Going back a step (a backoff) reports nothing again.
        let backoff = owner(State::Deactivated(FinalStep::Backoff(Retry::Check)));
        assert!(owner_notices(&waiting, &backoff).is_empty());
    }

    #[test]
    fn every_deactivated_step_has_a_progress() {
        use FinalStep::*;
        for step in [
            Killing,
            KillRetry,
            Settling,
            KillingAgain,
            KillAgainRetry,
            Fencing,
            AwaitingEtcd,
            Checking,
            ReadingRevision,
            Claiming,
            FixingIntent,
            Waiting,
            Taking,
            Recording(FinalOutcome::Taken),
            Backoff(Retry::Fence),
            Backoff(Retry::Check),
            Backoff(Retry::Unsettled),
            Done(FinalOutcome::FoundInStore),
        ] {
            assert!(progress(&State::Deactivated(step)).is_some());
        }
        assert_eq!(progress(&State::Active), None);
    }

    #[test]
    fn the_owner_record_lost_and_found() {
        let active = owner(State::Active);
        let suspended = owner(State::Suspended(KillStep::Killing));
        assert_eq!(
            reasons(&owner_notices(&owner(State::Starting), &active)),
            ["OwnershipConfirmed"]
        );
        assert_eq!(
            reasons(&owner_notices(&active, &suspended)),
            ["OwnerRecordUnresolved"]
        );
        assert!(owner_notices(&active, &suspended)[0].warning);
        assert_eq!(
            reasons(&owner_notices(&suspended, &active)),
            ["OwnerRecordResolved"]
        );
    }

    #[test]
    fn snapshot_failures_are_reported_when_they_start_and_end() {
        let ok = ActorStatus {
            gate: crate::snapshot::gate::Gate::Open,
            leader: true,
            last_full: None,
            last_delta: None,
            next_full_at: None,
            next_defrag_at: None,
            last_error: None,
            last_defrag: None,
        };
        let failing = ActorStatus {
            last_error: Some("store: connection refused".into()),
            ..ok.clone()
        };
        let still = ActorStatus {
            last_error: Some("store: timed out".into()),
            ..ok.clone()
        };
        assert_eq!(reasons(&actor_notices(&ok, &failing)), ["SnapshotFailed"]);
        assert!(
            actor_notices(&failing, &still).is_empty(),
            "one Warning per run of failures"
        );
        assert_eq!(reasons(&actor_notices(&still, &ok)), ["SnapshotRecovered"]);
        let moved = ActorStatus {
            last_defrag: Some(crate::snapshot::actor::DefragReport {
                defragmented: vec![1, 2],
                events: vec![DefragEvent::MovedLeader { from: 1, to: 2 }],
                snapshot: None,
            }),
            ..ok.clone()
        };
        assert_eq!(
            reasons(&actor_notices(&ok, &moved)),
            ["LeadershipMoved", "Defragmented"]
        );
        assert!(actor_notices(&moved, &moved.clone()).is_empty());
    }

    #[test]
    fn a_jobs_event_says_how_it_ended() {
        let ok = Job::Copy.notice(Ok(()));
        assert_eq!((ok.reason, ok.warning), ("CopyCompleted", false));
        let failed = Job::Drill.notice(Err("revision 9 missing"));
        assert_eq!((failed.reason, failed.warning), ("DrillFailed", true));
        assert!(failed.note.ends_with("revision 9 missing"));
    }

    #[test]
    fn a_reason_is_limited_and_the_next_one_published_says_how_many_were_not() {
        let t0 = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let mut l = Limiter::default();
        let n = || Notice::warning("SnapshotFailed", "Snapshot", "x".into());
        for _ in 0..BURST {
            assert!(l.admit(n(), t0).is_some());
        }
        assert!(l.admit(n(), t0).is_none());
        assert!(l.admit(n(), t0).is_none());
        // Another reason has its own bucket.
        assert!(
            l.admit(Notice::normal("Fenced", "HandOff", "y".into()), t0)
                .is_some()
        );
        let later = t0 + chrono::TimeDelta::seconds(REFILL.as_secs() as i64);
        let next = l.admit(n(), later).expect("refilled");
        assert!(next.note.contains("2 more since"), "{}", next.note);
        assert!(l.admit(n(), later).is_none());
    }
}
