//! The snapshot inventory: the API kept in step with the store, one `EtcdSnapshot` per full
//! snapshot.
//!
//! [`desired`] says what each object should hold from one listing of the store (pure);
//! [`plan`] compares that with the objects the API holds and says what to write (pure): a
//! missing object is created at once; a changed status is written at most once per
//! `kubernetes.inventory_interval` per object, however often deltas come; an object whose
//! snapshot left the store is deleted when retention deleted it ([`retired`]: retention's own
//! plan, run again over the store with the missing snapshots put back, deletes them) and
//! otherwise marked `Stored=False` (`Vanished`), never silently kept as if it were there.
//!
//! [`Inventory::run`] is the loop: the snapshot leader lists the store once per interval (and
//! again when it stores a full snapshot) and writes; a sidecar that is not the leader only
//! creates the object of a full snapshot it stored itself (a hand-off's final, taken by
//! whichever member the hand-off chose). Every request is bounded by
//! `kubernetes.request_timeout`; a failure is logged, counted and tried again at the next
//! round. Nothing here is awaited by a snapshot, an ownership check, the kill or the final.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::resource::{
    Chain, Condition, Drill, EtcdSnapshot, EtcdSnapshotSpec, EtcdSnapshotStatus, FIELD_MANAGER,
    OWNER_LABEL, SnapshotKind, human, object_name,
};
use crate::restore::drill::DrillRecord;
use crate::snapshot::actor::ActorStatus;
use crate::store::gc::{Retention, plan_with};
use crate::store::layout::{Kind, Snapshot, chain_from};

/// What the store says besides its listing.
#[derive(Debug, Clone, Default)]
pub struct Marks {
    /// Full snapshots taken on request (triggered markers and etcd-druid's requested finals).
    pub requested: HashSet<String>,
    /// Full snapshots `etcd-warden compact` wrote.
    pub compacted: HashSet<String>,
    /// The hand-off's final, as every reader decides it (`handoff::the_final`).
    pub the_final: Option<String>,
    /// Full snapshots this sidecar stored (their hash checked as they were uploaded).
    pub uploaded: HashSet<String>,
    /// Fingerprints of the recipients this sidecar encrypts to.
    pub recipients: Vec<String>,
    /// The store, without credentials.
    pub location: String,
}

/// One object as the store says it should be.
#[derive(Debug, Clone, PartialEq)]
pub struct Desired {
    /// The object's name.
    pub name: String,
    /// What the snapshot is.
    pub spec: EtcdSnapshotSpec,
    /// What the store and the drills say of it (`observed_at` unset).
    pub status: EtcdSnapshotStatus,
}

/// The objects one listing (`sorted` oldest first, with stored sizes) calls for.
pub fn desired(
    owner: &str,
    sorted: &[(Snapshot, u64)],
    marks: &Marks,
    drill: &DrillRecord,
    now: DateTime<Utc>,
) -> Vec<Desired> {
    let snapshots: Vec<Snapshot> = sorted.iter().map(|(s, _)| s.clone()).collect();
    let sizes: HashMap<&str, u64> = sorted
        .iter()
        .map(|(s, n)| (s.snap_name.as_str(), *n))
        .collect();
    let failed_on = failed_drill_target(&snapshots, drill);
    let mut out = Vec::new();
    for (i, s) in snapshots.iter().enumerate() {
        if s.kind != Kind::Full {
            continue;
        }
        // Its own stream: the deltas up to the next full snapshot (the next object's).
        let end = snapshots[i + 1..]
            .iter()
            .position(|n| n.kind == Kind::Full)
            .map_or(snapshots.len(), |p| i + 1 + p);
        let chain = chain_from(&snapshots[..end], Some(i));
        let bytes = chain
            .delta_snapshots
            .iter()
            .chain(std::iter::once(s))
            .map(|d| sizes.get(d.snap_name.as_str()).copied().unwrap_or(0))
            .sum();
        let last = chain.delta_snapshots.last();
        let kind = kind_of(s, marks);
        let uploaded = marks.uploaded.contains(&s.snap_name);
        let drilled = drill
            .last_report
            .as_ref()
            .filter(|r| r.full_snapshot == s.snap_name);
        let verdict = match (drilled, failed_on == Some(i)) {
            (_, true) => Some((
                "Failed",
                Drill {
                    at: drill.last_attempt,
                    revision: None,
                    keys: None,
                    error: drill.last_error.clone(),
                },
            )),
            (Some(r), false) => Some((
                "Passed",
                Drill {
                    at: drill.last_success,
                    revision: Some(r.revision),
                    keys: Some(r.keys),
                    error: None,
                },
            )),
            (None, false) => None,
        };
        let hash_check = match (&verdict, uploaded) {
            (Some(("Passed", _)), _) => "Drilled",
            (_, true) => "CheckedOnUpload",
            _ => "Unchecked",
        };
        out.push(Desired {
            name: object_name(owner, &s.snap_name),
            spec: EtcdSnapshotSpec {
                snapshot_name: s.snap_name.clone(),
                kind,
                revision: s.last_revision,
                taken_at: s.created_on,
                compression: codec_name(s),
                encryption: super::resource::Encryption {
                    encrypted: s.encrypted,
                    recipients: if s.encrypted && uploaded {
                        marks.recipients.clone()
                    } else {
                        Vec::new()
                    },
                },
                location: format!("{}/{}", marks.location.trim_end_matches('/'), s.key()),
            },
            status: EtcdSnapshotStatus {
                chain: Chain {
                    first_revision: s.last_revision,
                    last_revision: last.map_or(s.last_revision, |d| d.last_revision),
                    deltas: chain.delta_snapshots.len() as u64,
                    bytes,
                    size: human(bytes),
                    newest_delta_at: last.map(|d| d.created_on),
                },
                hash_check: hash_check.to_owned(),
                verified: verdict.as_ref().map_or("", |(v, _)| v).to_owned(),
                drill: verdict.map(|(_, d)| d),
                conditions: vec![stored(true, now)],
                observed_at: None,
            },
        });
    }
    out
}

/// The full snapshot a failed drill most likely restored: the newest one taken before the
/// failed attempt, when the last attempt failed.
fn failed_drill_target(sorted: &[Snapshot], drill: &DrillRecord) -> Option<usize> {
    let at = drill.last_attempt?;
    if drill.last_error.is_none() || drill.last_success.is_some_and(|ok| ok >= at) {
        return None;
    }
    sorted
        .iter()
        .rposition(|s| s.kind == Kind::Full && s.created_on <= at)
}

fn kind_of(s: &Snapshot, marks: &Marks) -> SnapshotKind {
    if marks.the_final.as_deref() == Some(s.snap_name.as_str()) {
        SnapshotKind::Final
    } else if marks.requested.contains(&s.snap_name) {
        SnapshotKind::Requested
    } else if marks.compacted.contains(&s.snap_name) {
        SnapshotKind::Compacted
    } else if s.is_final {
        SnapshotKind::Reclaimed
    } else {
        SnapshotKind::Scheduled
    }
}

fn codec_name(s: &Snapshot) -> String {
    match s.compression.suffix().trim_start_matches('.') {
        "" => "none".to_owned(),
        "gz" => "gzip".to_owned(),
        other => other.to_owned(),
    }
}

/// The `Stored` condition.
fn stored(present: bool, at: DateTime<Utc>) -> Condition {
    let (status, reason, message) = if present {
        ("True", "InStore", "the snapshot is in the store")
    } else {
        (
            "False",
            "Vanished",
            "the snapshot is no longer in the store and retention did not delete it: deleted by hand, by another tool, or the store was replaced; this object is kept until someone deletes it",
        )
    };
    Condition {
        r#type: "Stored".to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message: message.to_owned(),
        last_transition_time: at,
    }
}

/// Of the snapshots in `missing` (gone from the store), those retention deleted: retention's
/// plan over the store as listed with them put back deletes them (it deletes oldest first within
/// its rules, so what it deleted stays deleted by the same rules later). A missing snapshot it
/// would keep was deleted by something else.
pub fn retired(
    listed: &[Snapshot],
    missing: &[(Snapshot, SnapshotKind)],
    requested: &HashSet<String>,
    now: DateTime<Utc>,
    retention: Retention,
) -> HashSet<String> {
    let mut all = listed.to_vec();
    let mut requested = requested.clone();
    for (s, kind) in missing {
        all.push(s.clone());
        if *kind == SnapshotKind::Requested {
            requested.insert(s.snap_name.clone());
        }
    }
    let missing: HashSet<&str> = missing.iter().map(|(s, _)| s.snap_name.as_str()).collect();
    plan_with(&all, &requested, now, retention)
        .into_iter()
        .filter(|s| missing.contains(s.snap_name.as_str()))
        .map(|s| s.snap_name)
        .collect()
}

/// One write.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Create the object, then write its status.
    Create(Box<Desired>),
    /// Write the status of an existing object.
    Status {
        /// The object.
        name: String,
        /// The whole status.
        status: Box<EtcdSnapshotStatus>,
    },
    /// Correct what the object says the snapshot is (its kind, learnt after it was created:
    /// a hand-off's record written after its final).
    Spec {
        /// The object.
        name: String,
        /// The whole spec.
        spec: Box<EtcdSnapshotSpec>,
    },
    /// Delete the object: retention deleted its snapshot.
    Delete {
        /// The object.
        name: String,
    },
}

impl Action {
    /// The object written.
    pub fn name(&self) -> &str {
        match self {
            Action::Create(d) => &d.name,
            Action::Status { name, .. } | Action::Spec { name, .. } | Action::Delete { name } => {
                name
            }
        }
    }
}

/// What to write so that the API's `existing` objects (this owner's) follow `desired`:
/// creations and deletions at once, a status at most once per `interval` per object
/// (`written`: when each was last written by this process), and only when it changed.
/// `retired`: the names of the snapshots retention deleted (see [`retired`]).
pub fn plan(
    desired: &[Desired],
    existing: &[EtcdSnapshot],
    retired: &HashSet<String>,
    written: &HashMap<String, DateTime<Utc>>,
    now: DateTime<Utc>,
    interval: Duration,
) -> Vec<Action> {
    let by_name: BTreeMap<&str, &EtcdSnapshot> = existing
        .iter()
        .filter_map(|o| o.metadata.name.as_deref().map(|n| (n, o)))
        .collect();
    let due = |name: &str| {
        written
            .get(name)
            .is_none_or(|at| (now - *at).to_std().unwrap_or_default() >= interval)
    };
    let mut actions = Vec::new();
    let wanted: HashSet<&str> = desired.iter().map(|d| d.name.as_str()).collect();
    for d in desired {
        let Some(o) = by_name.get(d.name.as_str()) else {
            actions.push(Action::Create(Box::new(d.clone())));
            continue;
        };
        // Only the kind is learnt late; the rest was known when the object was created (the
        // recipients only by the sidecar that stored it).
        if o.spec.kind != d.spec.kind && due(&d.name) {
            actions.push(Action::Spec {
                name: d.name.clone(),
                spec: Box::new(EtcdSnapshotSpec {
                    kind: d.spec.kind,
                    ..o.spec.clone()
                }),
            });
        }
        let status = carried_over(&d.status, o.status.as_ref());
        if o.status.as_ref().is_none_or(|s| !same(s, &status)) && due(&d.name) {
            actions.push(Action::Status {
                name: d.name.clone(),
                status: Box::new(status),
            });
        }
    }
    for (name, o) in by_name {
        if wanted.contains(name) {
            continue;
        }
        if retired.contains(&o.spec.snapshot_name) {
            actions.push(Action::Delete {
                name: name.to_owned(),
            });
            continue;
        }
        let mut status = o.status.clone().unwrap_or_default();
        let gone = stored(false, now);
        if status.conditions.iter().any(|c| same_condition(c, &gone)) {
            continue;
        }
        status.conditions.retain(|c| c.r#type != "Stored");
        status.conditions.push(gone);
        if due(name) {
            actions.push(Action::Status {
                name: name.to_owned(),
                status: Box::new(status),
            });
        }
    }
    actions
}

/// `desired` with what the object already knows and the listing cannot: a hash check once
/// passed, the newest drill of this chain (the drill record names only the newest drill), and
/// each condition's transition time while its status holds.
fn carried_over(
    desired: &EtcdSnapshotStatus,
    had: Option<&EtcdSnapshotStatus>,
) -> EtcdSnapshotStatus {
    let mut s = desired.clone();
    let Some(had) = had else {
        return s;
    };
    let rank = |c: &str| match c {
        "Drilled" => 2,
        "CheckedOnUpload" => 1,
        _ => 0,
    };
    if rank(&had.hash_check) > rank(&s.hash_check) {
        s.hash_check = had.hash_check.clone();
    }
    if s.drill.is_none() && had.drill.is_some() {
        s.drill = had.drill.clone();
        s.verified = had.verified.clone();
    }
    for c in &mut s.conditions {
        if let Some(old) = had.conditions.iter().find(|o| o.r#type == c.r#type)
            && old.status == c.status
        {
            c.last_transition_time = old.last_transition_time;
        }
    }
    s
}

/// Equal but for when it was written and when conditions last changed.
fn same(a: &EtcdSnapshotStatus, b: &EtcdSnapshotStatus) -> bool {
    let strip = |s: &EtcdSnapshotStatus| {
        let mut s = s.clone();
        s.observed_at = None;
        for c in &mut s.conditions {
            c.last_transition_time = DateTime::<Utc>::MIN_UTC;
        }
        s
    };
    strip(a) == strip(b)
}

fn same_condition(a: &Condition, b: &Condition) -> bool {
    (&a.r#type, &a.status, &a.reason) == (&b.r#type, &b.status, &b.reason)
}

/// Short SHA-256 fingerprints of age recipients, as the objects show them.
pub fn fingerprints(recipients: &[String]) -> Vec<String> {
    use sha2::{Digest, Sha256};
    recipients
        .iter()
        .map(|r| {
            Sha256::digest(r.trim().as_bytes())
                .iter()
                .take(8)
                .map(|b| format!("{b:02x}"))
                .collect()
        })
        .collect()
}

/// The full snapshots taken on request: the triggered markers and etcd-druid's requested
/// finals, as retention reads them (`gc::run`).
async fn requested_names(store: &crate::store::SnapshotStore) -> Result<HashSet<String>, String> {
    let mut requested = crate::store::gc::triggered_names(store)
        .await
        .map_err(|e| format!("listing the triggered markers: {e}"))?;
    requested.extend(
        crate::store::gc::requested_finals(store)
            .await
            .map_err(|e| format!("listing the requested finals: {e}"))?,
    );
    Ok(requested)
}

/// The inventory's counters, for `/metrics`.
#[derive(Clone, Debug, Default)]
pub struct InventoryMetrics {
    writes: prometheus_client::metrics::counter::Counter,
    failures: prometheus_client::metrics::counter::Counter,
    objects: prometheus_client::metrics::gauge::Gauge,
}

impl InventoryMetrics {
    /// Registers `etcd_warden_kubernetes_inventory_*`.
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        let r = registry.sub_registry_with_prefix("etcd_warden_kubernetes_inventory");
        r.register(
            "writes",
            "Writes (create, status, delete) of EtcdSnapshot objects",
            self.writes.clone(),
        );
        r.register(
            "failures",
            "Inventory rounds or writes that failed (the API or the store); tried again next round",
            self.failures.clone(),
        );
        r.register(
            "objects",
            "Full snapshots in the store at the last round (EtcdSnapshot objects wanted)",
            self.objects.clone(),
        );
    }

    /// Writes so far (tests).
    pub fn writes(&self) -> u64 {
        self.writes.get()
    }
}

/// The inventory of one sidecar.
pub struct Inventory {
    /// Objects in `[kubernetes].namespace`.
    pub api: Api<EtcdSnapshot>,
    /// `[kubernetes]`.
    pub config: crate::config::KubernetesConfig,
    /// The store listed.
    pub store: crate::store::SnapshotStore,
    /// Retention's settings, to tell its deletions from others.
    pub retention: Retention,
    /// Fingerprints of the recipients, and the store's location.
    pub marks: Marks,
    /// Where the drills' Events go.
    pub notices: super::events::Notices,
    /// Counters.
    pub metrics: InventoryMetrics,
}

impl Inventory {
    /// Runs until `cancel`: a round per interval, and one as soon as this sidecar stores a full
    /// snapshot (its object is created then, leader or not).
    pub async fn run(mut self, mut actor: watch::Receiver<ActorStatus>, cancel: CancellationToken) {
        let mut written: HashMap<String, DateTime<Utc>> = HashMap::new();
        let mut tick = tokio::time::interval(self.config.inventory_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_full: Option<String> = None;
        let mut drill_seen: Option<Option<DateTime<Utc>>> = None;
        loop {
            let woke_for_full = tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => false,
                changed = actor.changed() => {
                    if changed.is_err() {
                        // The actor is gone: the sidecar is stopping.
                        cancel.cancelled().await;
                        return;
                    }
                    let full = actor.borrow().last_full.as_ref().map(|s| s.snap_name.clone());
                    if full.is_none() || full == last_full {
                        continue;
                    }
                    true
                }
            };
            let status = actor.borrow().clone();
            if let Some(full) = &status.last_full {
                self.marks.uploaded.insert(full.snap_name.clone());
                last_full = Some(full.snap_name.clone());
            }
            // A round is bounded as a whole, whatever the store and the API do.
            let bound = self.config.request_timeout.saturating_mul(6);
            let round = async {
                if status.leader {
                    self.round(&mut written, &mut drill_seen).await
                } else if woke_for_full && let Some(full) = &status.last_full {
                    self.create_own(full).await
                } else {
                    Ok(())
                }
            };
            match tokio::time::timeout(bound, round).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    self.metrics.failures.inc();
                    tracing::warn!(error = %e, "snapshot inventory: round failed; tried again at the next");
                }
                Err(_) => {
                    self.metrics.failures.inc();
                    tracing::warn!(after = ?bound, "snapshot inventory: round timed out; tried again at the next");
                }
            }
        }
    }

    async fn bounded<T>(
        &self,
        what: &str,
        f: impl std::future::Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, String> {
        match tokio::time::timeout(self.config.request_timeout, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(format!("{what}: {e}")),
            Err(_) => Err(format!(
                "{what}: no answer within {:?}",
                self.config.request_timeout
            )),
        }
    }

    /// Lists the store and the API, and writes what [`plan`] says.
    async fn round(
        &mut self,
        written: &mut HashMap<String, DateTime<Utc>>,
        drill_seen: &mut Option<Option<DateTime<Utc>>>,
    ) -> Result<(), String> {
        let now = Utc::now();
        let store = self.store.clone();
        let listing = store
            .listing()
            .await
            .map_err(|e| format!("listing the store: {e}"))?;
        let sorted = listing.snapshots;
        let snapshots: Vec<Snapshot> = sorted.iter().map(|(s, _)| s.clone()).collect();
        self.marks.requested = requested_names(&store).await?;
        self.marks.compacted = crate::store::gc::compacted_names(&store)
            .await
            .map_err(|e| format!("listing the compacted markers: {e}"))?;
        let seen = crate::owner::handoff::HandOffObjects::new(store.clone())
            .seen()
            .await
            .map_err(|e| format!("reading the hand-off objects: {e}"))?;
        self.marks.the_final =
            crate::owner::handoff::the_final(&snapshots, &seen).map(|s| s.snap_name.clone());
        let drill = crate::restore::drill::read_record(&store)
            .await
            .map_err(|e| format!("reading the drill record: {e}"))?;
        let want = desired(&self.config.owner, &sorted, &self.marks, &drill, now);
        // A drill that ended since the last round (the first round only learns where they
        // stand): an Event on the object of the chain it judged.
        if drill_seen.is_some_and(|seen| seen != drill.last_attempt) {
            self.drill_notice(&want, &drill);
        }
        *drill_seen = Some(drill.last_attempt);
        self.metrics.objects.set(want.len() as i64);

        let selector = format!("{OWNER_LABEL}={}", self.config.owner);
        let existing = self
            .bounded(
                "listing EtcdSnapshots",
                self.api.list(&ListParams::default().labels(&selector)),
            )
            .await?
            .items;
        let wanted: HashSet<&str> = want.iter().map(|d| d.name.as_str()).collect();
        let missing: Vec<(Snapshot, SnapshotKind)> = existing
            .iter()
            .filter(|o| {
                !o.metadata
                    .name
                    .as_deref()
                    .is_some_and(|n| wanted.contains(n))
            })
            .filter_map(|o| {
                Snapshot::parse_name(store.prefix(), &o.spec.snapshot_name)
                    .ok()
                    .map(|s| (s, o.spec.kind))
            })
            .collect();
        let retired = retired(
            &snapshots,
            &missing,
            &self.marks.requested,
            now,
            self.retention,
        );
        let actions = plan(
            &want,
            &existing,
            &retired,
            written,
            now,
            self.config.inventory_interval,
        );
        let mut failed = Vec::new();
        for action in actions {
            let name = action.name().to_owned();
            match self.apply(action, now).await {
                Ok(()) => {
                    self.metrics.writes.inc();
                    written.insert(name, now);
                }
                Err(e) => {
                    self.metrics.failures.inc();
                    failed.push(e);
                }
            }
        }
        written.retain(|n, _| {
            wanted.contains(n.as_str())
                || existing
                    .iter()
                    .any(|o| o.metadata.name.as_deref() == Some(n))
        });
        match failed.first() {
            None => Ok(()),
            Some(first) => Err(format!(
                "{} write(s) failed, the first: {first}",
                failed.len()
            )),
        }
    }

    fn drill_notice(&self, want: &[Desired], drill: &DrillRecord) {
        use super::events::Notice;
        let judged = want.iter().rev().find(|d| {
            d.status
                .drill
                .as_ref()
                .is_some_and(|r| r.at.is_some() && r.at == drill.last_attempt)
        });
        let regarding = judged.map(|d| k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some("etcd-warden.io/v1alpha1".into()),
            kind: Some("EtcdSnapshot".into()),
            name: Some(d.name.clone()),
            namespace: Some(self.config.namespace.clone()),
            ..Default::default()
        });
        let of = judged.map_or(String::new(), |d| format!(" of {}", d.spec.snapshot_name));
        let notice = match (&drill.last_error, &drill.last_report) {
            (Some(e), _) if drill.last_success != drill.last_attempt => Notice {
                warning: true,
                reason: "DrillFailed",
                action: "Drill",
                note: format!("restore drill{of} failed: {e}"),
                regarding,
            },
            (_, Some(r)) => Notice {
                warning: false,
                reason: "DrillPassed",
                action: "Drill",
                note: format!(
                    "restore drill{of} passed: {} keys at revision {} equal to the chain's",
                    r.keys, r.revision
                ),
                regarding,
            },
            _ => return,
        };
        self.notices.offer(notice);
    }

    /// A non-leader's one write: the object of the full snapshot it stored itself, its kind
    /// read from the store's markers and hand-off objects as a round reads them.
    async fn create_own(&self, full: &Snapshot) -> Result<(), String> {
        let store = &self.store;
        let requested = requested_names(store).await?;
        let seen = crate::owner::handoff::HandOffObjects::new(store.clone())
            .seen()
            .await
            .map_err(|e| format!("reading the hand-off objects: {e}"))?;
        let one = [full.clone()];
        let marks = Marks {
            the_final: crate::owner::handoff::the_final(&one, &seen)
                .filter(|s| !requested.contains(&s.snap_name))
                .map(|s| s.snap_name.clone()),
            requested,
            ..self.marks.clone()
        };
        for d in desired(
            &self.config.owner,
            &[(full.clone(), 0)],
            &marks,
            &DrillRecord::default(),
            Utc::now(),
        ) {
            self.create(&d).await?;
            self.metrics.writes.inc();
        }
        Ok(())
    }

    async fn apply(&self, action: Action, now: DateTime<Utc>) -> Result<(), String> {
        match action {
            Action::Create(d) => self.create(&d).await,
            Action::Status { name, status } => self.write_status(&name, *status, now).await,
            Action::Spec { name, spec } => {
                let patch = serde_json::json!({
                    "apiVersion": "etcd-warden.io/v1alpha1",
                    "kind": "EtcdSnapshot",
                    "spec": spec,
                });
                self.bounded(
                    &format!("correcting the spec of EtcdSnapshot {name}"),
                    self.api.patch(
                        &name,
                        &PatchParams::apply(FIELD_MANAGER).force(),
                        &Patch::Apply(&patch),
                    ),
                )
                .await
                .map(|_| ())
            }
            Action::Delete { name } => {
                match self
                    .bounded(
                        &format!("deleting EtcdSnapshot {name}"),
                        self.api.delete(&name, &DeleteParams::default()),
                    )
                    .await
                {
                    Ok(_) => {
                        tracing::info!(object = %name, "snapshot inventory: retention deleted the snapshot; object deleted");
                        Ok(())
                    }
                    Err(e) if e.contains("NotFound") || e.contains("404") => Ok(()),
                    Err(e) => Err(e),
                }
            }
        }
    }

    /// Creates the object (an existing one is left as it is), then writes its status.
    async fn create(&self, d: &Desired) -> Result<(), String> {
        let mut obj = EtcdSnapshot::new(&d.name, d.spec.clone());
        obj.metadata.labels = Some(
            [(OWNER_LABEL.to_owned(), self.config.owner.clone())]
                .into_iter()
                .collect(),
        );
        let created = self
            .bounded(
                &format!("creating EtcdSnapshot {}", d.name),
                self.api.create(&PostParams::default(), &obj),
            )
            .await;
        match created {
            Ok(_) => {
                tracing::info!(object = %d.name, kind = ?d.spec.kind, "snapshot inventory: object created")
            }
            Err(e) if e.contains("AlreadyExists") || e.contains("409") => {}
            Err(e) => return Err(e),
        }
        self.write_status(&d.name, d.status.clone(), Utc::now())
            .await
    }

    /// The whole status, by server-side apply with one field manager.
    async fn write_status(
        &self,
        name: &str,
        mut status: EtcdSnapshotStatus,
        now: DateTime<Utc>,
    ) -> Result<(), String> {
        status.observed_at = Some(now);
        let patch = serde_json::json!({
            "apiVersion": "etcd-warden.io/v1alpha1",
            "kind": "EtcdSnapshot",
            "status": status,
        });
        self.bounded(
            &format!("writing the status of EtcdSnapshot {name}"),
            self.api.patch_status(
                name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            ),
        )
        .await
        .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GcPolicy;
    use crate::store::Codec;

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000 + secs, 0).unwrap()
    }

    fn full(rev: i64, t: i64) -> Snapshot {
        Snapshot::new("p", Kind::Full, 0, rev, at(t), Codec::Gzip, false)
    }

    fn delta(from: i64, to: i64, t: i64) -> Snapshot {
        Snapshot::new("p", Kind::Incr, from, to, at(t), Codec::Gzip, false)
    }

    fn object(d: &Desired) -> EtcdSnapshot {
        let mut o = EtcdSnapshot::new(&d.name, d.spec.clone());
        o.status = Some(d.status.clone());
        o
    }

    fn listing() -> Vec<(Snapshot, u64)> {
        vec![
            (full(10, 0), 1000),
            (delta(11, 20, 10), 100),
            (full(20, 20), 2000),
            (delta(21, 30, 30), 50),
            (delta(31, 40, 40), 50),
        ]
    }

    #[test]
    fn each_full_snapshot_is_one_object_with_its_chain() {
        let marks = Marks {
            uploaded: ["Full-00000000-00000020-1700000020.gz".to_owned()].into(),
            ..Marks::default()
        };
        let want = desired("etcd", &listing(), &marks, &DrillRecord::default(), at(50));
        assert_eq!(want.len(), 2);
        let newest = &want[1];
        assert_eq!(newest.name, "etcd-full-00000000-00000020-1700000020.gz");
        assert_eq!(newest.spec.kind, SnapshotKind::Scheduled);
        assert_eq!(newest.spec.compression, "gzip");
        let c = &newest.status.chain;
        assert_eq!(
            (c.first_revision, c.last_revision, c.deltas, c.bytes),
            (20, 40, 2, 2100)
        );
        assert_eq!(c.newest_delta_at, Some(at(40)));
        assert_eq!(newest.status.hash_check, "CheckedOnUpload");
        assert_eq!(want[0].status.hash_check, "Unchecked");
    }

    #[test]
    fn a_drill_marks_its_chain_and_a_failed_one_the_newest_before_it() {
        let mut record = DrillRecord {
            last_attempt: Some(at(45)),
            last_success: Some(at(45)),
            last_report: Some(crate::restore::drill::DrillReport {
                full_snapshot: "Full-00000000-00000010-1700000000.gz".into(),
                deltas: 1,
                revision: 20,
                keys: 7,
                hash: String::new(),
                restore_seconds: 0.0,
                check_seconds: 0.0,
            }),
            ..DrillRecord::default()
        };
        let want = desired("etcd", &listing(), &Marks::default(), &record, at(50));
        assert_eq!(want[0].status.verified, "Passed");
        assert_eq!(want[0].status.hash_check, "Drilled");
        assert_eq!(want[1].status.verified, "");
        record.last_attempt = Some(at(48));
        record.last_error = Some("revision 39 missing".into());
        let want = desired("etcd", &listing(), &Marks::default(), &record, at(50));
        assert_eq!(want[1].status.verified, "Failed");
        assert_eq!(
            want[1].status.drill.as_ref().unwrap().error.as_deref(),
            Some("revision 39 missing")
        );
        assert_eq!(want[0].status.verified, "Passed", "its own drill stays");
    }

    #[test]
    fn kinds_come_from_the_markers_and_the_hand_off() {
        let mut fin = full(30, 30);
        fin.is_final = true;
        fin.snap_name = fin.format_name();
        let mut reclaimed = full(25, 25);
        reclaimed.is_final = true;
        reclaimed.snap_name = reclaimed.format_name();
        let sorted = vec![
            (full(10, 0), 1),
            (full(20, 20), 1),
            (reclaimed, 1),
            (fin.clone(), 1),
        ];
        let marks = Marks {
            requested: ["Full-00000000-00000010-1700000000.gz".to_owned()].into(),
            compacted: ["Full-00000000-00000020-1700000020.gz".to_owned()].into(),
            the_final: Some(fin.snap_name.clone()),
            ..Marks::default()
        };
        let kinds: Vec<SnapshotKind> =
            desired("o", &sorted, &marks, &DrillRecord::default(), at(0))
                .iter()
                .map(|d| d.spec.kind)
                .collect();
        assert_eq!(
            kinds,
            [
                SnapshotKind::Requested,
                SnapshotKind::Compacted,
                SnapshotKind::Reclaimed,
                SnapshotKind::Final
            ]
        );
    }

    #[test]
    fn new_objects_are_created_and_statuses_written_once_per_interval() {
        let want = desired(
            "etcd",
            &listing(),
            &Marks::default(),
            &DrillRecord::default(),
            at(50),
        );
        let none = HashSet::new();
        let interval = Duration::from_secs(30);
        // Nothing there: both created.
        let actions = plan(&want, &[], &none, &HashMap::new(), at(50), interval);
        assert!(matches!(
            &actions[..],
            [Action::Create(_), Action::Create(_)]
        ));
        // In step: nothing to write.
        let existing: Vec<EtcdSnapshot> = want.iter().map(object).collect();
        assert!(plan(&want, &existing, &none, &HashMap::new(), at(51), interval).is_empty());
        // A delta came: the newest chain changes; written now, not again within the interval.
        let mut more = listing();
        more.push((delta(41, 50, 52), 50));
        let want2 = desired(
            "etcd",
            &more,
            &Marks::default(),
            &DrillRecord::default(),
            at(52),
        );
        let written: HashMap<String, DateTime<Utc>> =
            [(want[1].name.clone(), at(40))].into_iter().collect();
        let actions = plan(&want2, &existing, &none, &written, at(52), interval);
        assert!(
            actions.is_empty(),
            "written 12 s ago, the interval is 30 s: {actions:?}"
        );
        let actions = plan(&want2, &existing, &none, &written, at(71), interval);
        assert!(matches!(&actions[..], [Action::Status { name, .. }] if *name == want[1].name));
    }

    #[test]
    fn retentions_deletions_delete_the_object_and_other_losses_mark_it_vanished() {
        let retention = Retention {
            policy: GcPolicy::LimitBased { max_backups: 1 },
            delta_retention: Duration::ZERO,
        };
        let old = full(10, 0);
        let newer = full(20, 20);
        let newest = full(30, 40);
        // Retention (keep one) deleted `old` and `newer`'s chain; someone deleted `newest`? No:
        // the store holds `newest` only after retention; `newer` missing with `newest` present
        // is retention's, `old` too.
        let listed = vec![newest.clone()];
        let missing = vec![
            (old.clone(), SnapshotKind::Scheduled),
            (newer.clone(), SnapshotKind::Scheduled),
        ];
        let gone = retired(&listed, &missing, &HashSet::new(), at(50), retention);
        assert_eq!(gone.len(), 2, "{gone:?}");
        // With keep-three, retention would have kept both: deleted by something else.
        let keep3 = Retention {
            policy: GcPolicy::LimitBased { max_backups: 3 },
            ..retention
        };
        assert!(retired(&listed, &missing, &HashSet::new(), at(50), keep3).is_empty());

        let marks = Marks::default();
        let all: Vec<(Snapshot, u64)> =
            vec![(old.clone(), 1), (newer.clone(), 1), (newest.clone(), 1)];
        let before = desired("o", &all, &marks, &DrillRecord::default(), at(45));
        let existing: Vec<EtcdSnapshot> = before.iter().map(object).collect();
        let now_want = desired(
            "o",
            &[(newest.clone(), 1)],
            &marks,
            &DrillRecord::default(),
            at(50),
        );
        let retired_old: HashSet<String> = [old.snap_name.clone()].into();
        let actions = plan(
            &now_want,
            &existing,
            &retired_old,
            &HashMap::new(),
            at(50),
            Duration::from_secs(30),
        );
        assert_eq!(actions.len(), 2, "{actions:?}");
        assert!(actions.contains(&Action::Delete {
            name: before[0].name.clone()
        }));
        let Some(Action::Status { name, status }) =
            actions.iter().find(|a| matches!(a, Action::Status { .. }))
        else {
            panic!("no status write: {actions:?}");
        };
        assert_eq!(name, &before[1].name);
        let c = status
            .conditions
            .iter()
            .find(|c| c.r#type == "Stored")
            .unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "Vanished")
        );
        // Once marked, nothing more is written for it.
        let mut marked = existing.clone();
        marked[1].status = Some((**status).clone());
        let again = plan(
            &now_want,
            &marked[1..],
            &HashSet::new(),
            &HashMap::new(),
            at(90),
            Duration::from_secs(30),
        );
        assert!(again.is_empty(), "{again:?}");
    }

    #[test]
    fn what_the_object_knew_is_kept() {
        let want = desired(
            "etcd",
            &listing(),
            &Marks::default(),
            &DrillRecord::default(),
            at(50),
        );
        let mut existing: Vec<EtcdSnapshot> = want.iter().map(object).collect();
        let s = existing[1].status.as_mut().unwrap();
        s.hash_check = "CheckedOnUpload".into();
        s.verified = "Passed".into();
        s.drill = Some(Drill::default());
        s.conditions[0].last_transition_time = at(1);
        // A restarted sidecar knows neither: the object keeps them, nothing to write.
        let actions = plan(
            &want,
            &existing,
            &HashSet::new(),
            &HashMap::new(),
            at(60),
            Duration::from_secs(30),
        );
        assert!(actions.is_empty(), "{actions:?}");
    }
}
