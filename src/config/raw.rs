//! The raw layer: what the merged TOML tables deserialize into, before validation, and the
//! lenient parsers that read a value's text form.
//!
//! Values that are parsed later (durations, sizes, URLs) are strings here, so the environment and
//! flags (always text) feed the same code as the file. Unknown keys are rejected by serde.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

use super::REDACTED;

/// The merged configuration before validation; also what `etcd-warden config` prints.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub etcd: RawEtcd,
    pub store: RawStore,
    /// The copy job's source store; absent unless `copy` is used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_store: Option<RawStore>,
    pub copy: RawCopy,
    pub snapshot: RawSnapshot,
    pub defrag: RawDefrag,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<RawOwner>,
    pub kill: RawKill,
    pub server: RawServer,
    pub log: RawLog,
    pub restore: RawRestore,
    pub quorum_restore: RawQuorumRestore,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encryption: Option<RawEncryption>,
    /// Running under etcd-druid in place of etcd-backup-restore; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub druid: Option<RawDruid>,
    /// The Kubernetes face (snapshot inventory objects, Events); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<RawKubernetes>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKubernetes {
    #[serde(default)]
    pub namespace: String,
    #[serde(default)]
    pub owner: String,
    #[serde(default)]
    pub pod: String,
    #[serde(default)]
    pub pod_uid: String,
    #[serde(default)]
    pub kubeconfig: String,
    #[serde(default = "defaults::yes", deserialize_with = "lenient::boolean")]
    pub inventory: bool,
    #[serde(default = "defaults::inventory_interval")]
    pub inventory_interval: String,
    #[serde(default = "defaults::yes", deserialize_with = "lenient::boolean")]
    pub events: bool,
    #[serde(default = "defaults::kube_request_timeout")]
    pub request_timeout: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDruid {
    #[serde(default = "defaults::druid_etcd_config")]
    pub etcd_config: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_namespace: Option<String>,
    #[serde(default, deserialize_with = "lenient::boolean")]
    pub member_lease: bool,
    #[serde(default = "defaults::druid_heartbeat")]
    pub heartbeat: String,
    #[serde(default, deserialize_with = "lenient::boolean")]
    pub snapshot_leases: bool,
    #[serde(default = "defaults::druid_full_lease")]
    pub full_snapshot_lease: String,
    #[serde(default = "defaults::druid_delta_lease")]
    pub delta_snapshot_lease: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEtcd {
    #[serde(deserialize_with = "lenient::list")]
    pub endpoints: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_file: Option<String>,
    pub connect_timeout: String,
    pub request_timeout: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStore {
    pub url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    // Defaults here (not only in the embedded file) so an optional `[source_store]` set by URL
    // alone is complete.
    #[serde(
        default = "defaults::path_style",
        deserialize_with = "lenient::boolean"
    )]
    pub path_style: bool,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient::opt_boolean"
    )]
    pub allow_http: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_key_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_key_id_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_access_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_access_key_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub account_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub account_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub account_key_file: Option<String>,
    #[serde(default, deserialize_with = "lenient::boolean")]
    pub use_emulator: bool,
    /// `file://`: directories 0700, files 0600; on unless set false.
    #[serde(default = "defaults::private", deserialize_with = "lenient::boolean")]
    pub private: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role_arn: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub web_identity_token_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sts_endpoint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_side_encryption: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sse_kms_key_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sse_customer_key_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub federated_token_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authority_host: Option<String>,
    /// S3 Object Lock: how long each new snapshot is retained (a duration; absent: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object_lock_retention: Option<String>,
    /// `governance` (the default) or `compliance`; only with `object_lock_retention`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object_lock_mode: Option<String>,
    /// `[store.secondary]`: a second store every snapshot is copied to. Only `[store]` may
    /// have one (validation refuses it elsewhere).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secondary: Option<Box<RawStore>>,
    /// `store.secondary.max_lag`: only in `[store.secondary]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_lag: Option<String>,
    /// `store.secondary.sync_interval`: only in `[store.secondary]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_interval: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCopy {
    #[serde(deserialize_with = "lenient::boolean")]
    pub wait_for_final: bool,
    #[serde(deserialize_with = "lenient::boolean")]
    pub druid_final: bool,
    pub final_timeout: String,
    pub poll_interval: String,
    #[serde(deserialize_with = "lenient::unsigned")]
    pub max_backups: u64,
    pub max_age: String,
    #[serde(deserialize_with = "lenient::unsigned")]
    pub parallel: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSnapshot {
    pub schedule: String,
    pub delta_period: String,
    pub delta_memory_limit: String,
    pub compression: String,
    #[serde(deserialize_with = "lenient::unsigned")]
    pub compression_level: u64,
    pub gc_policy: String,
    #[serde(deserialize_with = "lenient::unsigned")]
    pub max_backups: u64,
    pub gc_period: String,
    pub delta_retention: String,
    pub leader_check_interval: String,
    pub timeout: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDefrag {
    pub schedule: String,
    pub timeout: String,
    #[serde(deserialize_with = "lenient::number")]
    pub min_free_fraction: f64,
    pub check_interval: String,
    pub trigger_min_db_size: String,
    #[serde(deserialize_with = "lenient::number")]
    pub trigger_min_free_fraction: f64,
    pub disable_file: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawOwner {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub id: String,
    #[serde(default = "defaults::owner_interval")]
    pub interval: String,
    #[serde(default = "defaults::owner_timeout")]
    pub timeout: String,
    #[serde(default, deserialize_with = "lenient::list")]
    pub nameservers: Vec<String>,
    #[serde(
        default = "defaults::failure_threshold",
        deserialize_with = "lenient::unsigned"
    )]
    pub failure_threshold: u64,
    #[serde(default = "defaults::ttl_cap")]
    pub ttl_cap: String,
    #[serde(default = "defaults::takeover_after")]
    pub takeover_after: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKill {
    pub process_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmdline_contains: Option<String>,
    pub grace: String,
    pub settle: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    pub listen: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_cert_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_key_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_client_ca_file: Option<String>,
    #[serde(default, deserialize_with = "lenient::boolean")]
    pub unauthenticated_snapshots: bool,
    pub header_read_timeout: String,
    pub request_timeout: String,
    pub idle_timeout: String,
    #[serde(deserialize_with = "lenient::unsigned")]
    pub max_connections: u64,
    #[serde(deserialize_with = "lenient::unsigned")]
    pub max_body_bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLog {
    pub format: String,
    pub level: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRestore {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_dir: Option<String>,
    pub name: String,
    #[serde(default)]
    pub initial_cluster: String,
    pub initial_cluster_token: String,
    pub initial_advertise_peer_urls: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd_bin: Option<String>,
    #[serde(deserialize_with = "lenient::unsigned")]
    pub parallel_fetch: u64,
    #[serde(deserialize_with = "lenient::boolean")]
    pub force: bool,
    #[serde(deserialize_with = "lenient::boolean")]
    pub initialize: bool,
    pub validation: String,
    #[serde(deserialize_with = "lenient::boolean")]
    pub fallback: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guard: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub work_dir: Option<String>,
    #[serde(default, deserialize_with = "lenient::list")]
    pub cluster_endpoints: Vec<String>,
    pub rejoin_timeout: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_cert_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_key_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_ca_file: Option<String>,
    #[serde(deserialize_with = "lenient::boolean")]
    pub peer_client_cert_auth: bool,
    #[serde(deserialize_with = "lenient::unsigned")]
    pub bump_revision: u64,
    #[serde(deserialize_with = "lenient::boolean")]
    pub mark_compacted: bool,
    /// Empty: derived from `snapshot.delta_memory_limit`.
    #[serde(default)]
    pub max_delta_size: String,
    #[serde(deserialize_with = "lenient::unsigned")]
    pub max_inflation_ratio: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawQuorumRestore {
    pub lost_for: String,
    pub probe_interval: String,
    #[serde(default)]
    pub machine: String,
    pub namespace: String,
    #[serde(default)]
    pub kubeconfig: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEncryption {
    #[serde(default, deserialize_with = "lenient::list")]
    pub recipients: Vec<String>,
    #[serde(default, deserialize_with = "lenient::list")]
    pub recipients_files: Vec<String>,
    #[serde(default, deserialize_with = "lenient::list")]
    pub identities: Vec<String>,
}

/// Defaults of keys inside an optional section (the section's absence means "off").
mod defaults {
    pub fn path_style() -> bool {
        true
    }
    pub fn private() -> bool {
        true
    }
    pub fn druid_etcd_config() -> String {
        "/var/etcd/config/etcd.conf.yaml".into()
    }
    pub fn druid_heartbeat() -> String {
        "30s".into()
    }
    pub fn druid_full_lease() -> String {
        "full-snapshot-revisions".into()
    }
    pub fn yes() -> bool {
        true
    }
    pub fn inventory_interval() -> String {
        "30s".into()
    }
    pub fn kube_request_timeout() -> String {
        "10s".into()
    }
    pub fn druid_delta_lease() -> String {
        "delta-snapshot-revisions".into()
    }
    pub fn owner_interval() -> String {
        "30s".into()
    }
    pub fn owner_timeout() -> String {
        "5s".into()
    }
    pub fn failure_threshold() -> u64 {
        3
    }
    pub fn ttl_cap() -> String {
        "10s".into()
    }
    pub fn takeover_after() -> String {
        "5m".into()
    }
}

/// Deserializers that accept a value's text form too, because the environment and flags only
/// carry text.
pub mod lenient {
    use super::*;

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum TextOr<T> {
        Value(T),
        Text(String),
    }

    fn parse_bool(s: &str) -> Option<bool> {
        match s.trim().to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => Some(true),
            "false" | "0" | "no" | "off" => Some(false),
            _ => None,
        }
    }

    pub fn boolean<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
        match TextOr::<bool>::deserialize(d)? {
            TextOr::Value(b) => Ok(b),
            TextOr::Text(s) => parse_bool(&s).ok_or_else(|| {
                serde::de::Error::custom(format!("expected true or false, got {s:?}"))
            }),
        }
    }

    pub fn opt_boolean<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
        boolean(d).map(Some)
    }

    pub fn unsigned<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        match TextOr::<u64>::deserialize(d)? {
            TextOr::Value(n) => Ok(n),
            TextOr::Text(s) => s.trim().parse().map_err(|_| {
                serde::de::Error::custom(format!("expected a non-negative whole number, got {s:?}"))
            }),
        }
    }

    pub fn number<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        match TextOr::<f64>::deserialize(d)? {
            TextOr::Value(n) => Ok(n),
            TextOr::Text(s) => s
                .trim()
                .parse()
                .map_err(|_| serde::de::Error::custom(format!("expected a number, got {s:?}"))),
        }
    }

    /// A TOML array of strings, or one string of comma-separated items.
    pub fn list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
        match TextOr::<Vec<String>>::deserialize(d)? {
            TextOr::Value(v) => Ok(v),
            TextOr::Text(s) => Ok(s
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect()),
        }
    }
}

impl RawConfig {
    /// A copy with every secret value replaced by [`REDACTED`] (file paths are kept).
    pub fn redacted(&self) -> RawConfig {
        let mut c = self.clone();
        let hide = |s: &mut Option<String>| {
            if s.is_some() {
                *s = Some(REDACTED.into());
            }
        };
        hide(&mut c.etcd.password);
        // A user name or password written into a URL (refused by validation, but printed
        // before it, e.g. by the fuzzer or a dump of what was given).
        let urls = |s: &mut RawStore| {
            s.url = super::redact_url(&s.url);
            for text in [&mut s.endpoint, &mut s.sts_endpoint, &mut s.authority_host]
                .into_iter()
                .flatten()
            {
                *text = super::redact_url(text);
            }
        };
        urls(&mut c.store);
        if let Some(s) = &mut c.store.secondary {
            urls(s);
        }
        if let Some(s) = &mut c.source_store {
            urls(s);
        }
        hide(&mut c.store.access_key_id);
        hide(&mut c.store.secret_access_key);
        hide(&mut c.store.account_key);
        if let Some(s) = &mut c.store.secondary {
            hide(&mut s.access_key_id);
            hide(&mut s.secret_access_key);
            hide(&mut s.account_key);
        }
        if let Some(s) = &mut c.source_store {
            hide(&mut s.access_key_id);
            hide(&mut s.secret_access_key);
            hide(&mut s.account_key);
        }
        hide(&mut c.server.token);
        // A private key pasted into a key list instead of a public key or a path.
        if let Some(e) = &mut c.encryption {
            for text in e
                .recipients
                .iter_mut()
                .chain(&mut e.recipients_files)
                .chain(&mut e.identities)
            {
                if super::keys::holds_private_key(text) {
                    *text = REDACTED.into();
                }
            }
        }
        c
    }

    /// The configuration as TOML, secrets redacted.
    pub fn to_redacted_toml(&self) -> String {
        toml::to_string_pretty(&self.redacted()).expect("configuration serializes to TOML")
    }
}

/// The longest duration any key accepts: 100 years (of 365.25 days, humantime's `y`, so `"100y"`
/// itself is accepted).
///
/// One bound for every key, because what it prevents depends on the size of a duration, not on
/// its key: a duration past chrono's range (dates end about 262,000 years from now) panicked the
/// snapshot actor's retention and the copy job's selection in `now - d`. A century is longer than
/// any meaningful period, timeout, age or retention (zero or empty already means "off" or "keep
/// all") and keeps `now - d` and `Instant::now() + d` far inside their ranges.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 31_557_600);

/// Parses a duration such as `"500ms"`, `"30s"`, `"1h30m"` or `"7d"`, at most [`MAX_DURATION`].
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text.trim()).map_err(|e| {
        format!("invalid duration {text:?} ({e}); write e.g. \"30s\", \"5m\", \"1h30m\"")
    })?;
    if d > MAX_DURATION {
        return Err(format!(
            "{text:?} is longer than the maximum of 100 years (\"100y\")"
        ));
    }
    Ok(d)
}

/// An IP address with an optional port (53 when absent).
pub(super) fn parse_nameserver(s: &str) -> Option<SocketAddr> {
    let s = s.trim();
    s.parse::<SocketAddr>().ok().or_else(|| {
        s.parse::<std::net::IpAddr>()
            .ok()
            .map(|ip| SocketAddr::new(ip, 53))
    })
}

/// Parses a byte size: `1048576`, `512KiB`, `100MiB`, `1GiB`, `10MB`.
pub(super) fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid size {s:?}; write e.g. \"100MiB\""))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1000,
        "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        other => {
            return Err(format!(
                "invalid size {s:?}: unknown unit {other:?} (use B, KiB, MiB, GiB)"
            ));
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_bytes("100MiB"), Ok(100 << 20));
        assert_eq!(parse_bytes("1 GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert!(
            parse_bytes("10 parsecs")
                .unwrap_err()
                .contains("unknown unit")
        );
        assert!(parse_bytes("MiB").is_err());
    }

    #[test]
    fn durations_are_bounded_at_a_century() {
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("100y"), Ok(MAX_DURATION));
        assert_eq!(parse_duration("36525d"), Ok(MAX_DURATION));
        for text in ["36525d 1s", "101y", "1000000y", "500000000000d"] {
            let e = parse_duration(text).unwrap_err();
            assert!(e.contains("maximum of 100 years"), "{text}: {e}");
        }
        assert!(
            parse_duration("99999999999999999999y")
                .unwrap_err()
                .contains("invalid duration")
        );
    }

    #[test]
    fn nameservers_default_to_port_53() {
        assert_eq!(
            parse_nameserver("10.0.0.10"),
            Some("10.0.0.10:53".parse().unwrap())
        );
        assert_eq!(
            parse_nameserver("127.0.0.1:5353"),
            Some("127.0.0.1:5353".parse().unwrap())
        );
        assert_eq!(
            parse_nameserver("[::1]:53"),
            Some("[::1]:53".parse().unwrap())
        );
        assert_eq!(parse_nameserver("dns.example"), None);
    }
}
