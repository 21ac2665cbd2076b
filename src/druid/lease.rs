//! The Leases etcd-druid reads, written as etcd-backup-restore writes them (gardener/
//! etcd-backup-restore `pkg/health/heartbeat`, at `debd95bd`), through the Kubernetes API with the
//! pod's ServiceAccount. druid creates every Lease; this only reads and patches them (JSON merge
//! patch), as druid's Role allows (get, patch, update; no create).
//!
//! - **Member Lease** (named after the member), every `druid.heartbeat`: `holderIdentity`
//!   `<member ID>:<cluster ID>:<Leader|Member>` (lowercase hexadecimal, unpadded, from a status
//!   call on the local etcd), `renewTime` now, and the annotation
//!   `member.etcd.gardener.cloud/tls-enabled` (`"true"` when every peer URL of the member is
//!   `https`). Not written while etcd does not answer: druid then sees the member go stale.
//! - **Full snapshot Lease**: `holderIdentity` the newest full snapshot's last revision (decimal),
//!   `renewTime` its creation time; written only when the revision grows, with the
//!   resourceVersion read (the compaction Job writes it too), again on a conflict.
//! - **Delta snapshot Lease**: `holderIdentity` the newest delta's last revision after the newest
//!   full snapshot (never lowered; `0` when there is none and nothing was set), `renewTime` now
//!   on every pass, so an idle cluster still shows backups working (druid's `BackupReady` wants
//!   it younger than twice the delta period).
//!
//! The snapshot Leases are written by the sidecar next to the raft leader (the one taking
//! snapshots), after each snapshot it stores and at least every delta period; what they say is
//! read from the store, so they describe what is there, whoever wrote it.

use std::time::Duration;

use chrono::{DateTime, Utc};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, Patch, PatchParams};
use tokio_util::sync::CancellationToken;

use crate::store::SnapshotStore;

/// The annotation druid reads to follow a peer TLS change.
pub const TLS_ENABLED: &str = "member.etcd.gardener.cloud/tls-enabled";

/// Why a Lease was not written.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("Lease {name}: {source}")]
    Api {
        name: String,
        #[source]
        source: kube::Error,
    },
    /// The Lease's holder is not a revision: something else writes it.
    #[error("Lease {name}: holderIdentity {value:?} is not a revision")]
    NotARevision { name: String, value: String },
    #[error("Lease {name}: still conflicting after {attempts} attempts")]
    Conflicts { name: String, attempts: u32 },
}

/// `<member>:<cluster>:<role>` as druid parses it.
pub fn member_holder(member_id: u64, cluster_id: u64, leader: bool) -> String {
    let role = if leader { "Leader" } else { "Member" };
    format!("{member_id:x}:{cluster_id:x}:{role}")
}

/// Whether every one of a member's peer URLs (comma-joined) is `https`.
pub fn tls_enabled(peer_urls: &str) -> bool {
    let urls: Vec<&str> = peer_urls
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect();
    !urls.is_empty() && urls.iter().all(|u| u.starts_with("https://"))
}

/// The full snapshot Lease's new holder: `Some(revision)` when it grows past `existing`.
pub fn full_holder(
    name: &str,
    existing: Option<&str>,
    revision: i64,
) -> Result<Option<String>, LeaseError> {
    match existing.map(str::trim).filter(|e| !e.is_empty()) {
        None => Ok(Some(revision.to_string())),
        Some(e) => {
            let held: i64 = e.parse().map_err(|_| LeaseError::NotARevision {
                name: name.to_string(),
                value: e.to_string(),
            })?;
            Ok((revision > held).then(|| revision.to_string()))
        }
    }
}

/// The delta snapshot Lease's holder after a pass: the newest delta's revision when it grows,
/// `0` for a Lease never set, else what it holds.
pub fn delta_holder(existing: Option<&str>, newest_delta: Option<i64>) -> String {
    let held = existing
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .and_then(|e| e.parse::<i64>().ok());
    match (held, newest_delta) {
        (Some(h), Some(d)) => h.max(d).to_string(),
        (None, Some(d)) => d.to_string(),
        (Some(h), None) => h.to_string(),
        (None, None) => existing
            .filter(|e| !e.trim().is_empty())
            .map_or_else(|| "0".to_string(), str::to_string),
    }
}

/// A `MicroTime` as the API takes it: RFC 3339 with microseconds.
fn micro(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()
}

/// Writes one Lease with a merge patch: `spec` and `annotations` set, the resourceVersion read
/// with `holder` computed from it, retried on a conflict. `holder` returns `None` to write
/// nothing.
async fn patch(
    api: &Api<Lease>,
    name: &str,
    mut holder: impl FnMut(Option<&str>) -> Result<Option<(String, DateTime<Utc>)>, LeaseError>,
    annotations: Option<serde_json::Value>,
) -> Result<bool, LeaseError> {
    const ATTEMPTS: u32 = 5;
    let err = |source| LeaseError::Api {
        name: name.to_string(),
        source,
    };
    for _ in 0..ATTEMPTS {
        let lease = api.get(name).await.map_err(err)?;
        let existing = lease
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.as_deref());
        let Some((holder, renewed)) = holder(existing)? else {
            return Ok(false);
        };
        let mut body = serde_json::json!({
            "metadata": { "resourceVersion": lease.metadata.resource_version },
            "spec": { "holderIdentity": holder, "renewTime": micro(renewed) },
        });
        if let Some(a) = &annotations {
            body["metadata"]["annotations"] = a.clone();
        }
        match api
            .patch(name, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(_) => return Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => return Err(err(e)),
        }
    }
    Err(LeaseError::Conflicts {
        name: name.to_string(),
        attempts: ATTEMPTS,
    })
}

/// Renews the member Lease once.
pub async fn renew_member(
    api: &Api<Lease>,
    name: &str,
    holder: String,
    tls: bool,
) -> Result<(), LeaseError> {
    let annotations = serde_json::json!({ TLS_ENABLED: tls.to_string() });
    patch(
        api,
        name,
        |_| Ok(Some((holder.clone(), Utc::now()))),
        Some(annotations),
    )
    .await?;
    Ok(())
}

/// The full snapshot Lease to `revision` made at `created`, unless it holds a newer one.
/// Whether it was written.
pub async fn update_full(
    api: &Api<Lease>,
    name: &str,
    revision: i64,
    created: DateTime<Utc>,
) -> Result<bool, LeaseError> {
    patch(
        api,
        name,
        |existing| Ok(full_holder(name, existing, revision)?.map(|h| (h, created))),
        None,
    )
    .await
}

/// The delta snapshot Lease renewed, its holder [`delta_holder`].
pub async fn update_delta(
    api: &Api<Lease>,
    name: &str,
    newest_delta: Option<i64>,
) -> Result<(), LeaseError> {
    patch(
        api,
        name,
        |existing| Ok(Some((delta_holder(existing, newest_delta), Utc::now()))),
        None,
    )
    .await?;
    Ok(())
}

/// Both snapshot Leases from the store's latest chain.
pub async fn update_snapshot_leases(
    api: &Api<Lease>,
    store: &SnapshotStore,
    full_name: &str,
    delta_name: &str,
) -> Result<(), String> {
    let chain = store
        .latest_chain()
        .await
        .map_err(|e| format!("listing the store: {e}"))?;
    if let Some(full) = &chain.full_snapshot {
        update_full(api, full_name, full.last_revision, full.created_on)
            .await
            .map_err(|e| e.to_string())?;
    }
    let newest_delta = chain.delta_snapshots.iter().map(|d| d.last_revision).max();
    update_delta(api, delta_name, newest_delta)
        .await
        .map_err(|e| e.to_string())
}

/// Logs a failed Lease write once per distinct error, then quietly retries.
pub(super) struct Quiet(Option<String>);

impl Quiet {
    pub(super) fn new() -> Self {
        Quiet(None)
    }

    pub(super) fn note(&mut self, what: &str, result: Result<(), String>) {
        match result {
            Ok(()) => {
                if self.0.take().is_some() {
                    tracing::info!(what, "Lease written again");
                }
            }
            Err(e) => {
                if self.0.as_deref() != Some(e.as_str()) {
                    tracing::warn!(what, error = %e, "cannot write the Lease; retrying");
                    self.0 = Some(e);
                }
            }
        }
    }
}

/// Waits `period` or until `cancel`; `false` when cancelled.
pub(super) async fn tick(period: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        _ = cancel.cancelled() => false,
        _ = tokio::time::sleep(period) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_are_what_druid_parses() {
        assert_eq!(
            member_holder(0x8e9e05c52164694d, 0xcdf818194e3a8c32, true),
            "8e9e05c52164694d:cdf818194e3a8c32:Leader"
        );
        assert_eq!(member_holder(0xa, 0x1, false), "a:1:Member");
        assert!(tls_enabled("https://a:2380,https://b:2380"));
        assert!(!tls_enabled("https://a:2380,http://b:2380"));
        assert!(!tls_enabled(""));
    }

    #[test]
    fn the_full_lease_only_grows_and_refuses_what_is_not_a_revision() {
        assert_eq!(full_holder("f", None, 7).unwrap(), Some("7".into()));
        assert_eq!(full_holder("f", Some(""), 7).unwrap(), Some("7".into()));
        assert_eq!(full_holder("f", Some("5"), 7).unwrap(), Some("7".into()));
        assert_eq!(full_holder("f", Some("7"), 7).unwrap(), None);
        assert_eq!(full_holder("f", Some("9"), 7).unwrap(), None);
        assert!(matches!(
            full_holder("f", Some("x"), 7),
            Err(LeaseError::NotARevision { .. })
        ));
    }

    #[test]
    fn the_delta_lease_never_goes_back_and_starts_at_zero() {
        assert_eq!(delta_holder(None, None), "0");
        assert_eq!(delta_holder(Some(""), None), "0");
        assert_eq!(delta_holder(None, Some(12)), "12");
        assert_eq!(delta_holder(Some("12"), None), "12");
        assert_eq!(delta_holder(Some("12"), Some(10)), "12");
        assert_eq!(delta_holder(Some("12"), Some(15)), "15");
    }
}
