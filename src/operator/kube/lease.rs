//! Leader election through a `coordination.k8s.io/v1` Lease, so two operator replicas never
//! both act.
//!
//! The protocol is client-go's: the holder renews `renewTime` every `retry` period; a candidate
//! takes the Lease over only when the record it observes has not changed for a whole
//! `duration` by its own clock (never by comparing its clock with the holder's `renewTime`), or
//! when nobody holds it. Every write carries the resourceVersion read, so of two candidates
//! racing for one expired Lease the API server lets exactly one through (the other gets 409).
//! The holder stops counting itself leader `renew_deadline` after the start of its last
//! successful renewal, before any candidate can take over (`renew_deadline < duration`).
//! Released on shutdown (holder cleared), so the next replica takes over at once.

use std::sync::Mutex;
use std::time::Duration;

use ::kube::api::Api;
use k8s_openapi::api::coordination::v1::Lease;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::json;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::machines::{KubeCall, is_status, post_params, send_merge_patch};

/// Timings of the election (client-go's defaults: 15 s, 10 s, 2 s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTiming {
    /// How long a record must stay unchanged before a candidate takes the Lease over.
    pub duration: Duration,
    /// How long after the start of its last successful renewal the holder still acts.
    pub renew_deadline: Duration,
    /// Between attempts, holder and candidates alike.
    pub retry: Duration,
}

impl Default for LeaseTiming {
    fn default() -> Self {
        LeaseTiming {
            duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry: Duration::from_secs(2),
        }
    }
}

/// The holder, renewal time and transition count: what a candidate watches for change.
type Record = (Option<String>, Option<String>, Option<i32>);

/// One replica's side of the election.
pub struct LeaseLock {
    api: Api<Lease>,
    name: String,
    identity: String,
    timing: LeaseTiming,
    /// The last record seen and when (by this replica's clock) it was first seen.
    observed: Mutex<Option<(Record, Instant)>>,
    metrics: LeaseMetrics,
}

/// Whether this replica holds the Lease, as a metric; cheap to clone (a shared handle).
#[derive(Debug, Clone, Default)]
pub struct LeaseMetrics {
    is_leader: Gauge,
}

impl LeaseMetrics {
    /// Registers `etcd_warden_operator_is_leader`.
    pub fn register(&self, registry: &mut Registry) {
        registry
            .sub_registry_with_prefix("etcd_warden_operator")
            .register(
                "is_leader",
                "1 while this replica holds the Lease and may act",
                self.is_leader.clone(),
            );
    }
}

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

fn seconds(d: Duration) -> i64 {
    i64::try_from(d.as_secs().max(1)).unwrap_or(i64::MAX)
}

impl LeaseLock {
    /// The Lease `name` in `api`'s namespace, contended for as `identity` (unique per replica,
    /// the pod name for instance).
    pub fn new(api: Api<Lease>, name: &str, identity: &str, timing: LeaseTiming) -> LeaseLock {
        LeaseLock {
            api,
            name: name.into(),
            identity: identity.into(),
            timing,
            observed: Mutex::new(None),
            metrics: LeaseMetrics::default(),
        }
    }

    /// Reports leadership through `metrics` too.
    pub fn with_metrics(mut self, metrics: LeaseMetrics) -> LeaseLock {
        self.metrics = metrics;
        self
    }

    /// This replica's identity.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    fn call(&self, what: &str, source: ::kube::Error) -> KubeCall {
        KubeCall {
            what: format!("{what} lease {}", self.name),
            source,
        }
    }

    /// The Lease as the API server has it now; `None` when it does not exist.
    async fn read(&self) -> Result<Option<Lease>, KubeCall> {
        self.api
            .get_opt(&self.name)
            .await
            .map_err(|e| self.call("reading", e))
    }

    /// Whether the observed record has stayed the same for a whole lease duration.
    fn expired(&self, record: &Record) -> bool {
        let mut seen = self.observed.lock().unwrap_or_else(|p| p.into_inner());
        match &*seen {
            Some((r, at)) if r == record => at.elapsed() >= self.timing.duration,
            _ => {
                *seen = Some((record.clone(), Instant::now()));
                false
            }
        }
    }

    /// One attempt to acquire or renew; `true` when this replica holds the Lease afterwards.
    pub async fn try_acquire_or_renew(&self) -> Result<bool, KubeCall> {
        let stamp = now();
        let duration = seconds(self.timing.duration);
        let Some(lease) = self.read().await? else {
            let lease: Lease = serde_json::from_value(json!({
                "metadata": {"name": self.name},
                "spec": {
                    "holderIdentity": self.identity,
                    "leaseDurationSeconds": duration,
                    "acquireTime": stamp,
                    "renewTime": stamp,
                    "leaseTransitions": 0,
                },
            }))
            .map_err(|e| self.call("building", ::kube::Error::SerdeError(e)))?;
            let pp = post_params();
            return match self.api.create(&pp, &lease).await {
                Ok(_) => Ok(true),
                // Another candidate created it first.
                Err(e) if is_status(&e, 409) => Ok(false),
                Err(e) => Err(self.call("creating", e)),
            };
        };
        let spec = lease.spec.unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let record: Record = (
            holder.clone(),
            serde_json::to_value(&spec.renew_time)
                .ok()
                .and_then(|v| v.as_str().map(String::from)),
            spec.lease_transitions,
        );
        let ours = holder.as_deref() == Some(self.identity.as_str());
        let expired = self.expired(&record);
        if !ours && holder.is_some() && !expired {
            return Ok(false);
        }
        let rv = lease.metadata.resource_version;
        let patch = if ours {
            json!({
                "metadata": {"resourceVersion": rv},
                "spec": {"renewTime": stamp, "leaseDurationSeconds": duration},
            })
        } else {
            json!({
                "metadata": {"resourceVersion": rv},
                "spec": {
                    "holderIdentity": self.identity,
                    "leaseDurationSeconds": duration,
                    "acquireTime": stamp,
                    "renewTime": stamp,
                    "leaseTransitions": spec.lease_transitions.unwrap_or(0) + 1,
                },
            })
        };
        match send_merge_patch(&self.api, &self.name, &patch).await {
            Ok(_) => {
                if !ours {
                    info!(lease = %self.name, identity = %self.identity, previous = ?holder, "lease acquired");
                }
                Ok(true)
            }
            // Someone else wrote first: not ours this round.
            Err(e) if is_status(&e, 409) => Ok(false),
            Err(e) => Err(self.call("writing", e)),
        }
    }

    /// Gives the Lease up if this replica holds it, so another takes over at once.
    pub async fn release(&self) -> Result<(), KubeCall> {
        let Some(lease) = self.read().await? else {
            return Ok(());
        };
        let holder = lease
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.as_deref());
        if holder != Some(self.identity.as_str()) {
            return Ok(());
        }
        let patch = json!({
            "metadata": {"resourceVersion": lease.metadata.resource_version},
            "spec": {"holderIdentity": null, "leaseDurationSeconds": 1, "renewTime": now()},
        });
        match send_merge_patch(&self.api, &self.name, &patch).await {
            Ok(_) => {
                info!(lease = %self.name, identity = %self.identity, "lease released");
                Ok(())
            }
            // Changed meanwhile: then it was no longer ours to release.
            Err(e) if is_status(&e, 409) => Ok(()),
            Err(e) => Err(self.call("releasing", e)),
        }
    }

    /// Contends until `cancel`, publishing on `leader` whether this replica may act; releases
    /// the Lease (if held) on the way out.
    pub async fn run(&self, leader: watch::Sender<bool>, cancel: CancellationToken) {
        let mut acting_until: Option<Instant> = None;
        loop {
            let started = Instant::now();
            let attempt = tokio::select! {
                _ = cancel.cancelled() => break,
                r = tokio::time::timeout(self.timing.renew_deadline, self.try_acquire_or_renew()) => r,
            };
            match attempt {
                Ok(Ok(true)) => acting_until = Some(started + self.timing.renew_deadline),
                Ok(Ok(false)) => acting_until = None,
                Ok(Err(e)) => warn!(lease = %self.name, error = %e, "lease attempt failed"),
                Err(_) => warn!(lease = %self.name, "lease attempt timed out"),
            }
            let acting = acting_until.is_some_and(|t| Instant::now() < t);
            leader.send_if_modified(|l| std::mem::replace(l, acting) != acting);
            self.metrics.is_leader.set(i64::from(acting));
            let wake = match acting_until {
                Some(t) if acting => (started + self.timing.retry).min(t),
                _ => started + self.timing.retry,
            };
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep_until(wake) => {}
            }
        }
        leader.send_if_modified(|l| std::mem::replace(l, false));
        self.metrics.is_leader.set(0);
        if let Err(e) = self.release().await {
            warn!(lease = %self.name, error = %e, "releasing the lease");
        }
    }
}
