//! The ControlPlaneSet on Kubernetes: [`run`], the loop that keeps the Machines at the
//! `ControlPlaneSet` named `cluster` (see [`resource`]), through [`KubeSetMachines`] (the
//! seam's backend, in [`super::set_machines`]).
//!
//! The loop runs beside the quorum operator (spawned by `operator::kube::controller::run`),
//! acts only while that replica holds the Lease, is woken by watches on the ControlPlaneSets and
//! the Machines, and resyncs every `interval` (etcd, which the planner also looks at, is
//! observed, not watched); a failed reconcile is retried with backoff. No ControlPlaneSet named
//! `cluster`: it stays idle, quietly. No such resource type installed (the CRD not applied): it
//! says so once (a log line and the detail [`run`]'s `report` shows on `/healthz`), looks again
//! after a backoff that doubles from `interval` to `missing_type_max_wait`, watches no set
//! meanwhile, and starts when the type appears.
//!
//! Each reconcile reads the set, puts the orphaning finalizer on it, validates it
//! ([`resource::validate`]; on first sight also that as many Machines match as
//! `replicas`, and always that the quorum operator can carry out the strategy; refused: a
//! Degraded condition and nothing else), and runs one
//! [`Controller`] step: adoptions, then at most one Machine created or deleted. The status is
//! written only through `/status`, and only when it changed. A deleting set has its label
//! taken off every Machine (never a Machine deleted), then its finalizer removed.
//!
//! A Machine belongs to the set by the label [`SET_LABEL`], never by an owner reference (why:
//! [`super::set_machines`]). Every write here is a merge patch naming only what it changes,
//! carrying the resourceVersion read when it replaces a list (owner references, finalizers).

use std::sync::Arc;
use std::time::Duration;

use ::kube::api::{Api, DynamicObject, ListParams, Patch};
use ::kube::core::ApiResource;
use ::kube::runtime::events::{Event, EventType, Recorder, Reporter};
use ::kube::runtime::{WatchStreamExt as _, watcher};
use ::kube::{Resource as _, ResourceExt as _};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::json;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use super::machines::{KubeCall, is_status, patch_params, send_merge_patch};
use super::set_machines::{
    ATTEMPTS, KubeSetMachines, SET_LABEL, labelled, machine_resource, other_owners, referenced,
};
use crate::operator::control_plane_set::controller::{Controller, ControllerError};
use crate::operator::control_plane_set::plan::{Action, Condition, Plan};
use crate::operator::control_plane_set::resource::{
    self, AcceptedSpec, ControlPlaneSet, ControlPlaneSetStatus, FINALIZER, NAME,
};
use crate::operator::quorum::execute::{BackendError, Machines, Operator};
use crate::operator::quorum::plan::Replacement;

/// What the set's loop needs besides a client and the quorum operator.
#[derive(Debug, Clone)]
pub struct SetSettings {
    /// Namespace of the ControlPlaneSet and its Machines.
    pub namespace: String,
    /// Scheme of etcd's peer URLs.
    pub peer_scheme: String,
    /// etcd's peer port.
    pub peer_port: u16,
    /// Resync period.
    pub interval: Duration,
    /// First retry delay after a failed reconcile (doubling).
    pub min_backoff: Duration,
    /// Longest retry delay.
    pub max_backoff: Duration,
    /// This replica's identity, in Events.
    pub identity: String,
    /// How the quorum operator orders a replacement's membership changes; the set's strategy
    /// must agree with it ([`resource::fits_quorum_operator`]), else the set refuses to act.
    pub replacement: Replacement,
    /// Longest wait between two looks for a resource type not installed.
    pub missing_type_max_wait: Duration,
}

/// Errors of one reconcile.
#[derive(Debug, thiserror::Error)]
pub enum SetError {
    /// A call to the API server failed.
    #[error(transparent)]
    Api(#[from] KubeCall),
    /// A controller step failed (etcd or the Machines).
    #[error(transparent)]
    Step(#[from] ControllerError),
    /// A Machine could not be changed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// A list-replacing patch kept meeting concurrent changes.
    #[error("{0}: still conflicting after {ATTEMPTS} attempts")]
    Conflict(String),
}

fn call(what: impl Into<String>) -> impl FnOnce(::kube::Error) -> KubeCall {
    let what = what.into();
    move |source| KubeCall { what, source }
}

fn set_resource() -> ApiResource {
    ApiResource::erase::<ControlPlaneSet>(&())
}

/// What one reconcile did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// Wrote or acted: look again soon.
    Acted,
    /// Nothing to do until something changes.
    Idle,
    /// The ControlPlaneSet resource type is not installed.
    Missing,
}

/// What `/healthz` shows while the resource type is missing.
pub const WAITING_FOR_TYPE: &str = "waiting for the ControlPlaneSet resource type (CRD controlplanesets.etcd-warden.io not installed)";

struct Parts<Q: Machines> {
    client: ::kube::Client,
    sets: Api<DynamicObject>,
    machines: Api<DynamicObject>,
    operator: Arc<Operator<Q>>,
    settings: SetSettings,
    recorder: Recorder,
}

impl<Q: Machines> Parts<Q> {
    async fn reconcile(&self) -> Result<Outcome, SetError> {
        let sets = match self.sets.list(&ListParams::default()).await {
            Ok(l) => l.items,
            Err(e) if is_status(&e, 404) => return Ok(Outcome::Missing),
            Err(e) => return Err(call("listing ControlPlaneSets")(e).into()),
        };
        let mut outcome = Outcome::Idle;
        for other in sets.iter().filter(|s| s.name_any() != NAME) {
            // Refused, whatever else it says: only `cluster` is ever acted on.
            if let Err(e) =
                resource::validate(&serde_json::to_value(other).unwrap_or_default(), None)
                && self
                    .write_status(other, |s| self.refuse(s, other, &e))
                    .await?
            {
                outcome = Outcome::Acted;
            }
        }
        let Some(set) = sets.iter().find(|s| s.name_any() == NAME) else {
            return Ok(outcome);
        };
        if set.metadata.deletion_timestamp.is_some() {
            return self.orphan(set).await;
        }
        if !set.finalizers().iter().any(|f| f == FINALIZER) {
            self.set_finalizer(set, true).await?;
            return Ok(Outcome::Acted);
        }
        let raw = serde_json::to_value(set).unwrap_or_default();
        let previous = match status_of(set) {
            Ok(s) => s,
            Err(e) => {
                warn_once(set, &conditions_of_unreadable(set), &e.to_string());
                self.write_status(set, |s| self.refuse(s, set, &e)).await?;
                return Ok(Outcome::Idle);
            }
        };
        let valid = match resource::validate(&raw, previous.accepted.as_ref()) {
            Ok(v) => v,
            Err(e) => {
                warn_once(set, &previous, &e.to_string());
                self.write_status(set, |s| self.refuse(s, set, &e)).await?;
                return Ok(Outcome::Idle);
            }
        };
        // First sight: the set takes over the control plane as it is, never resizes it.
        let first = match previous.accepted {
            Some(_) => Ok(()),
            None => {
                let existing = self
                    .machines
                    .list(&ListParams::default().labels(&valid.selector))
                    .await
                    .map_err(call("listing the machines the set would adopt"))?
                    .items
                    .iter()
                    .filter(|m| m.metadata.deletion_timestamp.is_none())
                    .count();
                resource::fits_existing(valid.config.replicas, existing)
            }
        };
        if let Err(e) = first.and_then(|()| {
            resource::fits_quorum_operator(valid.config.strategy, self.settings.replacement)
        }) {
            warn_once(set, &previous, &e.to_string());
            self.write_status(set, |s| self.refuse(s, set, &e)).await?;
            return Ok(Outcome::Idle);
        }
        // Accepted before anything is acted on: a surge Machine created by a step whose status
        // write then failed must not make the next reconcile see a first sight over 4 Machines.
        if previous.accepted.is_none() {
            let accepted = valid.accepted.clone();
            self.write_status(set, |s| s.accepted = Some(accepted))
                .await?;
            info!(set = %set.name_any(), replicas = valid.accepted.replicas, selector = %valid.selector, "ControlPlaneSet accepted");
            return Ok(Outcome::Acted);
        }
        let backend = KubeSetMachines::new(
            self.client.clone(),
            &self.settings.namespace,
            (&self.settings.peer_scheme, self.settings.peer_port),
            set,
            &valid,
        );
        let controller = Controller::new(
            valid.config.clone(),
            valid.field,
            Arc::new(backend),
            Arc::clone(&self.operator),
        );
        // Inactive: observed and reported, never acted on (no adoption either: that patches).
        let stepped = if valid.active {
            controller.step().await
        } else {
            controller.observe().await.map(inactive)
        };
        let plan = match stepped {
            Ok(p) => p,
            // Refused for good (a Machine another controller owns, a Machine the API server
            // will not take): an administrator's matter, so a condition says it, not only a log.
            Err(ControllerError::Backend(e @ BackendError::Rejected { .. })) => {
                let refusal = resource::Invalid {
                    reason: "MachineActionRefused",
                    field: "machines".into(),
                    message: e.to_string(),
                };
                warn_once(set, &previous, &refusal.to_string());
                self.write_status(set, |s| self.refuse(s, set, &refusal))
                    .await?;
                return Err(ControllerError::Backend(e).into());
            }
            Err(e) => return Err(e.into()),
        };
        self.publish(set, &plan).await;
        if let Some(d) = plan
            .conditions
            .iter()
            .find(|c| c.kind == "Degraded" && c.status)
        {
            warn_once(set, &previous, &d.message);
        }
        let generation = set.metadata.generation;
        let accepted = valid.accepted.clone();
        let replicas = valid.config.replicas;
        self.write_status(set, |s| {
            let now = Time(k8s_openapi::jiff::Timestamp::now());
            let (current, ready, updated, unavailable) = resource::counts(&plan.counts, replicas);
            s.observed_generation = generation;
            s.replicas = current;
            s.ready_replicas = ready;
            s.updated_replicas = updated;
            s.unavailable_replicas = unavailable;
            s.conditions = resource::conditions(&plan.conditions, &s.conditions, generation, &now);
            s.accepted = Some(accepted.clone());
        })
        .await?;
        Ok(if plan.actions.is_empty() {
            Outcome::Idle
        } else {
            Outcome::Acted
        })
    }

    /// `s` with the refusal's conditions (the accepted fields kept).
    fn refuse(&self, s: &mut ControlPlaneSetStatus, set: &DynamicObject, e: &resource::Invalid) {
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        s.observed_generation = set.metadata.generation;
        s.conditions = resource::refused(e, &s.conditions, set.metadata.generation, &now);
    }

    /// Writes the status `change` makes of the current one through `/status`, when it differs;
    /// returns whether it wrote.
    async fn write_status(
        &self,
        set: &DynamicObject,
        change: impl FnOnce(&mut ControlPlaneSetStatus),
    ) -> Result<bool, SetError> {
        // An unreadable status is patched from empty: `accepted` is None there and so left out
        // of the merge patch, which keeps whatever the server holds.
        let before = status_of(set).unwrap_or_else(|_| conditions_of_unreadable(set));
        let mut after = before.clone();
        change(&mut after);
        if after == before {
            return Ok(false);
        }
        let patch = json!({"status": after});
        let name = set.name_any();
        self.sets
            .patch_status(&name, &patch_params(), &Patch::Merge(&patch))
            .await
            .map_err(call(format!(
                "writing the status of ControlPlaneSet {name}"
            )))?;
        Ok(true)
    }

    /// Adds the set's finalizer (`add`) or takes it off, leaving every other finalizer: on the
    /// version read, and after a 409 on the set read again (the garbage collector takes its
    /// `foregroundDeletion` or `orphan` finalizer off a deleting set while this runs), up to
    /// [`ATTEMPTS`] times. A set gone or replaced by another of the same name meanwhile needs
    /// nothing more.
    async fn set_finalizer(&self, set: &DynamicObject, add: bool) -> Result<(), SetError> {
        let name = set.name_any();
        let what = if add {
            "adding the finalizer"
        } else {
            "removing the finalizer"
        };
        let mut current = set.clone();
        for attempt in 1..=ATTEMPTS {
            let mut finalizers: Vec<&String> = current
                .finalizers()
                .iter()
                .filter(|f| *f != FINALIZER)
                .collect();
            let ours = FINALIZER.to_owned();
            if add {
                finalizers.push(&ours);
            }
            let patch = json!({"metadata": {
                "finalizers": finalizers,
                "resourceVersion": current.metadata.resource_version,
            }});
            match send_merge_patch(&self.sets, &name, &patch).await {
                Ok(_) => {
                    info!(set = %name, "{what}");
                    return Ok(());
                }
                Err(e) if is_status(&e, 409) => {
                    debug!(set = %name, attempt, "{what}: the set changed meanwhile, reading it again");
                    let fresh = self
                        .sets
                        .get_opt(&name)
                        .await
                        .map_err(call(format!("reading ControlPlaneSet {name}")))?;
                    match fresh {
                        Some(f) if f.uid() == set.uid() => current = f,
                        _ => return Ok(()),
                    }
                    if current.finalizers().iter().any(|f| f == FINALIZER) == add {
                        return Ok(());
                    }
                }
                Err(e) => return Err(call(format!("{what} on ControlPlaneSet {name}"))(e).into()),
            }
        }
        Err(SetError::Conflict(format!(
            "{what} on ControlPlaneSet {name}"
        )))
    }

    /// A deleting set: takes its label (and any owner reference to it an earlier version
    /// wrote) off every Machine, leaving the Machines, then its finalizer off.
    async fn orphan(&self, set: &DynamicObject) -> Result<Outcome, SetError> {
        if !set.finalizers().iter().any(|f| f == FINALIZER) {
            return Ok(Outcome::Idle);
        }
        let uid = set.uid().unwrap_or_default();
        'machine: for attempt in 1..=ATTEMPTS {
            let list = self
                .machines
                .list(&ListParams::default())
                .await
                .map_err(call("listing machines to orphan"))?;
            for m in list
                .items
                .iter()
                .filter(|m| labelled(m, &uid) || referenced(m, &uid))
            {
                let mut meta = json!({
                    "labels": {SET_LABEL: null},
                    "resourceVersion": m.metadata.resource_version,
                });
                if referenced(m, &uid) {
                    meta["ownerReferences"] = json!(other_owners(m, &uid));
                }
                let patch = json!({"metadata": meta});
                let name = m.name_any();
                match send_merge_patch(&self.machines, &name, &patch).await {
                    Ok(_) => {
                        info!(machine = %name, "orphaned: the ControlPlaneSet is being deleted");
                        self.event(
                            set,
                            "Orphan",
                            "MachineOrphaned",
                            format!("machine {name} left in place, no longer the set's"),
                            Some(&name),
                        )
                        .await;
                    }
                    Err(e) if is_status(&e, 409) || is_status(&e, 404) => {
                        tokio::time::sleep(Duration::from_millis(20 * u64::from(attempt))).await;
                        continue 'machine;
                    }
                    Err(e) => {
                        return Err(call(format!("orphaning machine {name}"))(e).into());
                    }
                }
            }
            self.set_finalizer(set, false).await?;
            return Ok(Outcome::Acted);
        }
        Err(SetError::Conflict("orphaning the machines".into()))
    }

    async fn publish(&self, set: &DynamicObject, plan: &Plan) {
        for a in &plan.actions {
            let (action, reason, machine) = match a {
                Action::Adopt { machine } => ("Adopt", "MachineAdopted", Some(machine)),
                Action::Create { replaces, .. } => ("Create", "MachineCreated", replaces.as_ref()),
                Action::Delete { machine, .. } => ("Delete", "MachineDeleted", Some(machine)),
            };
            self.event(
                set,
                action,
                reason,
                a.to_string(),
                machine.map(String::as_str),
            )
            .await;
        }
    }

    /// An Event on the set, related to `machine` (the Machine it names, or the one a new
    /// Machine replaces) when there is one; one that cannot be published is logged and dropped.
    /// The related Machine is also what keeps two Machines' events apart: events of one object,
    /// reason and related object are counted as one series, which keeps only the first note.
    async fn event(
        &self,
        set: &DynamicObject,
        action: &str,
        reason: &str,
        note: String,
        machine: Option<&str>,
    ) {
        let ev = Event {
            type_: EventType::Normal,
            reason: reason.into(),
            note: Some(note),
            action: action.into(),
            secondary: machine.map(|name| ObjectReference {
                api_version: Some(machine_resource().api_version),
                kind: Some("Machine".into()),
                name: Some(name.into()),
                namespace: set.namespace(),
                ..ObjectReference::default()
            }),
        };
        let about = set.object_ref(&set_resource());
        if let Err(e) = self.recorder.publish(&ev, &about).await {
            warn!(reason, error = %e, "publishing an event");
        }
    }
}

/// An Inactive set's plan: its actions are only reported, in a `Progressing=False, Inactive`
/// condition saying what an Active set would do; nothing is acted on or published.
fn inactive(mut plan: Plan) -> Plan {
    let would: Vec<String> = plan.actions.iter().map(ToString::to_string).collect();
    let message = if would.is_empty() {
        "spec.state is Inactive: the Machines are as the set would keep them".to_owned()
    } else {
        format!(
            "spec.state is Inactive; when Active the set would: {}",
            would.join("; ")
        )
    };
    plan.conditions.retain(|c| c.kind != "Progressing");
    plan.conditions.push(Condition {
        kind: "Progressing",
        status: false,
        reason: "Inactive",
        message,
    });
    plan.actions.clear();
    plan
}

/// The set's status as read. An unreadable one (a field of the wrong shape, written by hand or by
/// another version) is an error naming the field: read as empty it would drop `accepted`, and the
/// next reconcile would accept the spec again, immutable fields and all.
fn status_of(set: &DynamicObject) -> Result<ControlPlaneSetStatus, resource::Invalid> {
    let Some(raw) = set.data.get("status") else {
        return Ok(ControlPlaneSetStatus::default());
    };
    serde_path_to_error::deserialize(raw).map_err(|e| resource::Invalid {
        reason: "StatusUnreadable",
        field: format!("status.{}", e.path()),
        message: format!(
            "cannot be read ({}); the set is not acted on until the status is fixed or removed \
             through the status subresource",
            e.inner()
        ),
    })
}

/// The conditions of a status [`status_of`] cannot read, as far as they can be read (so that a
/// refusal already reported is not logged again).
fn conditions_of_unreadable(set: &DynamicObject) -> ControlPlaneSetStatus {
    let conditions = set
        .data
        .get("status")
        .and_then(|s| s.get("conditions"))
        .cloned()
        .and_then(|c| serde_json::from_value(c).ok())
        .unwrap_or_default();
    ControlPlaneSetStatus {
        conditions,
        ..Default::default()
    }
}

/// Logs why the set is degraded when it is new (not already the Degraded condition's message).
fn warn_once(set: &DynamicObject, previous: &ControlPlaneSetStatus, text: &str) {
    let known = previous
        .conditions
        .iter()
        .any(|c| c.type_ == "Degraded" && c.status == "True" && c.message == text);
    if !known {
        warn!(set = %set.name_any(), degraded = %text, "ControlPlaneSet degraded");
    }
}

/// Wakes the loop on every change `api`'s watch reports; the first failure of a streak is a
/// warning, the rest (a missing resource type, say) are quiet.
async fn trigger(api: Api<DynamicObject>, wake: Arc<Notify>, cancel: CancellationToken) {
    let mut events = Box::pin(watcher(api, watcher::Config::default()).default_backoff());
    let mut failing = false;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            ev = events.next() => match ev {
                Some(Ok(_)) => {
                    failing = false;
                    wake.notify_one();
                }
                Some(Err(e)) if !failing => {
                    failing = true;
                    debug!(error = %e, "watch failed; retrying with backoff");
                }
                Some(Err(_)) => {}
                None => return,
            },
        }
    }
}

/// Runs the set's controller until `cancel`, acting only while `leader` is true; `report` is
/// told what the loop waits for ([`WAITING_FOR_TYPE`]) and `None` once it no longer does.
pub async fn run<Q: Machines>(
    client: ::kube::Client,
    settings: SetSettings,
    operator: Arc<Operator<Q>>,
    mut leader: watch::Receiver<bool>,
    cancel: CancellationToken,
    report: impl Fn(Option<&str>) + Send,
) {
    let parts = Parts {
        sets: Api::namespaced_with(client.clone(), &settings.namespace, &set_resource()),
        machines: Api::namespaced_with(client.clone(), &settings.namespace, &machine_resource()),
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: "etcd-warden-operator".into(),
                instance: Some(settings.identity.clone()),
            },
        ),
        client,
        operator,
        settings,
    };
    let tasks = TaskTracker::new();
    let child = cancel.child_token();
    let _stop_tasks = child.clone().drop_guard();
    let wake = Arc::new(Notify::new());
    tasks.spawn(trigger(
        parts.machines.clone(),
        Arc::clone(&wake),
        child.clone(),
    ));
    // The sets' watch starts once their type is known to be installed: a watch on a missing
    // type would list it again and again.
    let mut watching_sets = false;

    let backoff =
        crate::backoff::Backoff::new(parts.settings.min_backoff, parts.settings.max_backoff);
    let missing_backoff = crate::backoff::Backoff::new(
        parts.settings.interval,
        parts.settings.missing_type_max_wait,
    );
    let mut failures = 0u32;
    let mut missing = 0u32;
    'run: loop {
        while !*leader.borrow_and_update() {
            tokio::select! {
                _ = cancel.cancelled() => break 'run,
                changed = leader.changed() => if changed.is_err() { break 'run },
            }
        }
        loop {
            let result = tokio::select! {
                _ = cancel.cancelled() => break 'run,
                _ = leader.wait_for(|l| !*l) => continue 'run,
                r = parts.reconcile() => r,
            };
            if matches!(result, Ok(Outcome::Acted | Outcome::Idle)) {
                if missing > 0 {
                    info!(
                        "the ControlPlaneSet resource type is installed; the set's controller starts"
                    );
                    report(None);
                    missing = 0;
                }
                if !watching_sets {
                    tasks.spawn(trigger(
                        parts.sets.clone(),
                        Arc::clone(&wake),
                        child.clone(),
                    ));
                    watching_sets = true;
                }
            }
            let wait = match result {
                Ok(Outcome::Missing) => {
                    missing = missing.saturating_add(1);
                    if missing == 1 {
                        info!(
                            max_wait = ?parts.settings.missing_type_max_wait,
                            "the ControlPlaneSet resource type is not installed (apply deploy/operator/crds.yaml); the set's controller waits for it"
                        );
                        report(Some(WAITING_FOR_TYPE));
                    }
                    missing_backoff.delay(missing)
                }
                Ok(Outcome::Acted) => {
                    failures = 0;
                    Duration::from_millis(50)
                }
                Ok(Outcome::Idle) => {
                    failures = 0;
                    parts.settings.interval
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    parts.operator.metrics().set_reconcile_failed();
                    let retry_in = backoff.delay(failures);
                    warn!(error = %e, ?retry_in, "ControlPlaneSet reconcile failed");
                    retry_in
                }
            };
            tokio::select! {
                _ = cancel.cancelled() => break 'run,
                _ = leader.wait_for(|l| !*l) => continue 'run,
                // A Machine changing says nothing about a missing type.
                _ = wake.notified(), if missing == 0 => {}
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }
    child.cancel();
    tasks.close();
    if tokio::time::timeout(Duration::from_secs(5), tasks.wait())
        .await
        .is_err()
    {
        warn!("ControlPlaneSet watch tasks did not stop within 5s");
    }
}

/// The accepted immutable fields of a set's status, if any (for tests and tools).
pub fn accepted(set: &DynamicObject) -> Option<AcceptedSpec> {
    status_of(set).ok().and_then(|s| s.accepted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set_with(data: serde_json::Value) -> DynamicObject {
        DynamicObject::new(NAME, &ApiResource::erase::<ControlPlaneSet>(&())).data(data)
    }

    /// An unreadable status is an error naming the field, never an empty status: read as empty
    /// it would drop `accepted`, and the next reconcile would accept the spec again.
    #[test]
    fn an_unreadable_status_is_an_error_naming_the_field() {
        let broken = set_with(json!({"status": {"accepted": {"replicas": "three"}}}));
        let e = status_of(&broken).unwrap_err();
        assert_eq!(
            (e.reason, e.field.as_str()),
            ("StatusUnreadable", "status.accepted.replicas")
        );
        assert_eq!(accepted(&broken), None);
        // No status yet is an empty one.
        assert_eq!(
            status_of(&set_with(json!({}))).unwrap(),
            ControlPlaneSetStatus::default()
        );
    }
}
