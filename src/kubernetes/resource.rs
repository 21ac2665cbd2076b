//! `EtcdSnapshot`: one object per full snapshot in the store, as `kubectl get etcdsnapshots`
//! shows them (kind, revision, size, age, verified).
//!
//! The **spec** is what the snapshot is and never changes once stored (its name, kind, revision,
//! time, codec, encryption, where it is); the **status** is what the store and the drills say of
//! it now: its chain of deltas, the hash check, the newest drill's verdict, whether it is still
//! in the store. Only the snapshot leader's sidecar writes them (`kubernetes::inventory`), by
//! server-side apply with one field manager.

use ::kube::CustomResource;
use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The label naming the owning object (`kubernetes.owner`): one cluster's objects.
pub const OWNER_LABEL: &str = "etcd-warden.io/owner";
/// The field manager of every write.
pub const FIELD_MANAGER: &str = "etcd-warden";

/// What a full snapshot is; fixed once it is stored.
// Clippy reads the repeated `type_ = ...` of separate printcolumns as one duplicated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema)]
#[kube(
    group = "etcd-warden.io",
    version = "v1alpha1",
    kind = "EtcdSnapshot",
    namespaced,
    status = "EtcdSnapshotStatus",
    shortname = "esnap",
    doc = "One full snapshot of etcd in the backup store, with its chain of delta snapshots (status); kept by the snapshot leader's sidecar",
    printcolumn(name = "Kind", type_ = "string", json_path = ".spec.kind"),
    printcolumn(
        name = "Revision",
        type_ = "integer",
        json_path = ".status.chain.lastRevision"
    ),
    printcolumn(name = "Size", type_ = "string", json_path = ".status.chain.size"),
    printcolumn(name = "Age", type_ = "date", json_path = ".spec.takenAt"),
    printcolumn(name = "Verified", type_ = "string", json_path = ".status.verified"),
    printcolumn(
        name = "Stored",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Stored\")].status",
        priority = 1
    )
)]
#[serde(rename_all = "camelCase")]
pub struct EtcdSnapshotSpec {
    /// The object's name in the store (`Full-<start>-<last>-<unix time>[.gz][.age][.final]`).
    #[schemars(length(max = 253))]
    pub snapshot_name: String,
    /// Scheduled, Requested (taken on request: an operator's, etcd-druid's), Final (a hand-off's
    /// last snapshot), Compacted or Reclaimed.
    pub kind: SnapshotKind,
    /// The etcd revision it holds.
    pub revision: i64,
    /// When it was taken (the name's time).
    #[schemars(with = "String")]
    pub taken_at: DateTime<Utc>,
    /// The payload's compression: `gzip`, `zstd`, ... or `none`.
    #[schemars(length(max = 16))]
    pub compression: String,
    /// Encrypted with age; `recipients` are the SHA-256 fingerprints (16 hex digits) of the
    /// public keys it was encrypted to, when the sidecar that stored it said so.
    pub encryption: Encryption,
    /// The store and key, without credentials.
    #[schemars(length(max = 2048))]
    pub location: String,
}

/// How a full snapshot came to be.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, JsonSchema)]
pub enum SnapshotKind {
    /// Taken on the schedule (or at start).
    Scheduled,
    /// Taken on request (HTTP, etcd-druid's on-demand snapshot or requested final).
    Requested,
    /// A hand-off's final: the last snapshot of a seed that stopped owning etcd.
    Final,
    /// Written by `etcd-warden compact`: the chain restored, compacted and snapshotted again.
    Compacted,
    /// Named final, but no reader takes it as the hand-off's final: reclaimed (`etcd-warden
    /// reclaim`) or left by an earlier hand-off.
    Reclaimed,
}

/// A snapshot's encryption.
#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Encryption {
    /// The payload is an age file.
    pub encrypted: bool,
    /// Fingerprints of the recipients, when known.
    #[schemars(length(max = 64))]
    pub recipients: Vec<String>,
}

/// What the store and the drills say of the snapshot now.
#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EtcdSnapshotStatus {
    /// The full snapshot and its stream: the deltas after it up to the next full snapshot.
    pub chain: Chain,
    /// `CheckedOnUpload` (the sidecar checked etcd's SHA-256 as it stored it), `Drilled` (a
    /// restore drill of its chain passed) or `Unchecked`.
    pub hash_check: String,
    /// The newest restore drill of this chain: `Passed`, `Failed` or empty.
    pub verified: String,
    /// The newest drill's time and what it found, or why it failed.
    pub drill: Option<Drill>,
    /// `Stored`: True while the snapshot is in the store; False (reason `Vanished`) once it is
    /// gone without retention having deleted it.
    #[schemars(length(max = 8))]
    pub conditions: Vec<Condition>,
    /// When the sidecar last wrote this status.
    #[schemars(with = "Option<String>")]
    pub observed_at: Option<DateTime<Utc>>,
}

/// A full snapshot's chain.
#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Chain {
    /// The full snapshot's revision.
    pub first_revision: i64,
    /// The newest revision a restore of the chain reaches.
    pub last_revision: i64,
    /// Delta snapshots in the chain.
    pub deltas: u64,
    /// Stored bytes of the full snapshot and its deltas.
    pub bytes: u64,
    /// `bytes` for people (`12.3 MiB`).
    #[schemars(length(max = 32))]
    pub size: String,
    /// When the newest delta was taken.
    #[schemars(with = "Option<String>")]
    pub newest_delta_at: Option<DateTime<Utc>>,
}

/// A restore drill's verdict on a chain.
#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Drill {
    /// When it ended.
    #[schemars(with = "Option<String>")]
    pub at: Option<DateTime<Utc>>,
    /// The revision it restored to, when it passed.
    pub revision: Option<i64>,
    /// Keys it compared, when it passed.
    pub keys: Option<u64>,
    /// Why it failed.
    #[schemars(length(max = 1024))]
    pub error: Option<String>,
}

/// A condition, as Kubernetes writes them.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// `Stored`.
    #[schemars(length(max = 64))]
    pub r#type: String,
    /// `True`, `False` or `Unknown`.
    #[schemars(length(max = 8))]
    pub status: String,
    /// CamelCase.
    #[schemars(length(max = 64))]
    pub reason: String,
    /// In words.
    #[schemars(length(max = 1024))]
    pub message: String,
    /// When `status` last changed.
    #[schemars(with = "String")]
    pub last_transition_time: DateTime<Utc>,
}

/// `bytes` as `kubectl` users read sizes.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// The object's name for snapshot `snap_name` of `owner`: `<owner>-<name>` lower-cased, every
/// character a DNS subdomain does not allow turned into `-`; a name too long for one (253) is
/// cut and ends with 10 hex digits of its SHA-256, so two long names never collide.
pub fn object_name(owner: &str, snap_name: &str) -> String {
    use sha2::{Digest, Sha256};
    let raw = format!("{owner}-{snap_name}").to_ascii_lowercase();
    let mut name: String = raw
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '-' | '.' => c,
            _ => '-',
        })
        .collect();
    const MAX: usize = 253;
    if name.len() > MAX {
        let digest = Sha256::digest(raw.as_bytes());
        let hex: String = digest.iter().take(5).map(|b| format!("{b:02x}")).collect();
        name.truncate(MAX - hex.len() - 1);
        name.push('-');
        name.push_str(&hex);
    }
    // A subdomain ends with a letter or digit.
    while name.ends_with(['-', '.']) {
        name.pop();
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_names_are_dns_subdomains_and_long_ones_stay_apart() {
        assert_eq!(
            object_name("etcd-main", "Full-00000000-00000123-1700000000.gz.final"),
            "etcd-main-full-00000000-00000123-1700000000.gz.final"
        );
        let long_a = format!("Full-{}-a", "0".repeat(300));
        let long_b = format!("Full-{}-b", "0".repeat(300));
        let (a, b) = (object_name("o", &long_a), object_name("o", &long_b));
        assert!(a.len() <= 253 && b.len() <= 253);
        assert_ne!(a, b);
        assert_eq!(object_name("o", "Full_x#"), "o-full-x");
    }

    #[test]
    fn sizes_read_as_kubectl_users_read_them() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(8 << 30), "8.0 GiB");
    }
}
