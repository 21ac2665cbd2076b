//! Layered configuration: embedded defaults → TOML file → `ETCD_WARDEN_*` environment → flags.
//!
//! Every layer is a TOML table; the layers are merged key by key and deserialized once into
//! [`RawConfig`] (unknown keys rejected), then validated into the immutable [`Config`] before
//! anything starts. Every error names the dotted key at fault and where its value came from.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

use crate::store::location::StoreLocation;

/// The embedded defaults: the first layer, and a complete description of every key's default.
pub const DEFAULTS: &str = include_str!("config_defaults.toml");

/// Prefix of every environment variable that sets a configuration key.
pub const ENV_PREFIX: &str = "ETCD_WARDEN_";

/// Environment variables with the prefix that are not configuration keys.
const ENV_NOT_KEYS: &[&str] = &["ETCD_WARDEN_CONFIG"];

/// What is shown instead of a secret's value.
pub const REDACTED: &str = "<redacted>";

/// A configuration error: one line naming the key (or variable) at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration: {key}{origin}: {message}")]
pub struct ConfigError {
    /// The dotted key (`snapshot.delta_period`), file, or environment variable at fault.
    pub key: String,
    /// ` (from ETCD_WARDEN_…)` or empty: where the offending value came from.
    pub origin: String,
    /// What is wrong with it.
    pub message: String,
}

impl ConfigError {
    /// An error about `key`.
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            origin: String::new(),
            message: message.into(),
        }
    }
}

/// Where environment variables come from: the process, or a map in tests (so tests never mutate
/// the process environment).
pub trait EnvSource {
    /// Every variable as (name, value).
    fn vars(&self) -> Vec<(String, String)>;
}

/// The process environment.
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn vars(&self) -> Vec<(String, String)> {
        std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .collect()
    }
}

impl EnvSource for HashMap<String, String> {
    fn vars(&self) -> Vec<(String, String)> {
        self.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }
}

/// One value set from the command line: a dotted key, its value as text, and the flag's name.
#[derive(Debug, Clone)]
pub struct Override {
    /// Dotted key, e.g. `store.url`.
    pub key: String,
    /// The value as typed; parsed as the key's type during validation.
    pub value: String,
    /// Shown in errors, e.g. `--store`.
    pub origin: String,
}

impl Override {
    /// An override of `key` from the flag `flag`.
    pub fn flag(key: &str, value: impl Into<String>, flag: &str) -> Self {
        Self {
            key: key.into(),
            value: value.into(),
            origin: flag.into(),
        }
    }
}

/// The inputs of [`Config::load`].
pub struct Sources<'a> {
    /// The `--config` file, if any.
    pub file: Option<&'a Path>,
    /// The environment.
    pub env: &'a dyn EnvSource,
    /// Flags, applied last.
    pub overrides: Vec<Override>,
}

// ---------------------------------------------------------------------------------------------
// Raw layer: what the merged TOML deserializes into. Strings where the text is parsed later, so
// the environment and flags (always text) feed the same code as the file.
// ---------------------------------------------------------------------------------------------

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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<RawOwner>,
    pub kill: RawKill,
    pub server: RawServer,
    pub log: RawLog,
    pub restore: RawRestore,
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
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCopy {
    #[serde(deserialize_with = "lenient::boolean")]
    pub wait_for_final: bool,
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
    pub gc_policy: String,
    #[serde(deserialize_with = "lenient::unsigned")]
    pub max_backups: u64,
    pub gc_period: String,
    pub delta_retention: String,
    pub leader_check_interval: String,
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
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKill {
    pub process_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmdline_contains: Option<String>,
    pub grace: String,
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guard: Option<String>,
}

/// Defaults of keys inside an optional section (the section's absence means "off").
mod defaults {
    pub fn path_style() -> bool {
        true
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
}

/// Deserializers that accept a value's text form too, because the environment and flags only
/// carry text.
mod lenient {
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

// ---------------------------------------------------------------------------------------------
// Validated configuration.
// ---------------------------------------------------------------------------------------------

/// A secret: given inline, or read from a file (re-read by its users when the file changes).
#[derive(Clone, PartialEq, Eq)]
pub enum Secret {
    /// The value itself.
    Value(String),
    /// A file holding the value (trailing newline trimmed).
    File(PathBuf),
}

impl Secret {
    /// The current value: read from the file each time for [`Secret::File`].
    pub fn read(&self) -> std::io::Result<String> {
        match self {
            Secret::Value(v) => Ok(v.clone()),
            Secret::File(p) => Ok(std::fs::read_to_string(p)?
                .trim_end_matches(['\r', '\n'])
                .to_string()),
        }
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Secret::Value(_) => f.write_str(REDACTED),
            Secret::File(p) => write!(f, "File({})", p.display()),
        }
    }
}

/// The validated, immutable configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub etcd: EtcdConfig,
    pub store: StoreConfig,
    /// The copy job's source; `None` when `[source_store]` is absent.
    pub source_store: Option<StoreConfig>,
    pub copy: CopyConfig,
    pub snapshot: SnapshotConfig,
    /// `None` when the `[owner]` section is absent: a plain backup sidecar.
    pub owner: Option<OwnerConfig>,
    pub kill: KillConfig,
    pub server: ServerConfig,
    pub log: LogConfig,
    pub restore: RestoreConfig,
}

/// How to reach the etcd member next to the sidecar.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    pub endpoints: Vec<String>,
    /// Client TLS, when the endpoints are `https://`.
    pub tls: Option<TlsFiles>,
    pub username: Option<String>,
    pub password: Option<Secret>,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
}

/// TLS material as files, re-read when they change (certificate rotation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

/// Where snapshots are kept, and the credentials to get there.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub location: StoreLocation,
    pub endpoint: Option<String>,
    pub region: Option<String>,
    pub path_style: bool,
    pub allow_http: bool,
    pub access_key_id: Option<Secret>,
    pub secret_access_key: Option<Secret>,
    pub service_account_file: Option<PathBuf>,
    pub account_name: Option<String>,
    pub account_key: Option<Secret>,
    pub use_emulator: bool,
}

impl StoreConfig {
    /// A store at `location` with the defaults of an empty `[store]` section (path-style, no
    /// explicit credentials: the provider's environment variables still apply).
    pub fn at(location: StoreLocation) -> Self {
        StoreConfig {
            location,
            endpoint: None,
            region: None,
            path_style: true,
            allow_http: false,
            access_key_id: None,
            secret_access_key: None,
            service_account_file: None,
            account_name: None,
            account_key: None,
            use_emulator: false,
        }
    }
}

/// The copy job (`etcd-warden copy`): source is `source_store`, destination is `store`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyConfig {
    /// Wait for the source's final snapshot before copying.
    pub wait_for_final: bool,
    /// How long to wait for it before copying anyway.
    pub final_timeout: Duration,
    /// How often to look for it.
    pub poll_interval: Duration,
    /// Copy only the newest this many full snapshots (and their deltas); 0 copies all.
    pub max_backups: u64,
    /// Copy only snapshots younger than this; `None` copies all.
    pub max_age: Option<Duration>,
    /// Objects copied at once (at least 1).
    pub parallel: usize,
}

/// Payload compression of new snapshots (all are readable whatever this says).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Compression {
    None,
    Gzip,
    Zlib,
}

/// Which full snapshots retention keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GcPolicy {
    /// Keep the newest `max_backups` full snapshots and their deltas.
    LimitBased { max_backups: u64 },
    /// Hourly for 24 h, daily for 7 days, weekly for 5 weeks.
    Exponential,
}

/// Snapshot schedule, deltas and retention.
#[derive(Debug, Clone)]
pub struct SnapshotConfig {
    /// Cron expression for full snapshots.
    pub schedule: croner::Cron,
    /// Zero disables deltas.
    pub delta_period: Duration,
    pub delta_memory_limit: u64,
    pub compression: Compression,
    pub gc_policy: GcPolicy,
    pub gc_period: Duration,
    /// Deltas older than this are deleted even when their full snapshot is kept; zero keeps them
    /// as long as their full snapshot.
    pub delta_retention: Duration,
    pub leader_check_interval: Duration,
}

/// The owner DNS record this sidecar checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerConfig {
    /// DNS name of the TXT record.
    pub name: String,
    /// This seed's owner ID: the record's value when we own etcd.
    pub id: String,
    pub interval: Duration,
    /// Per-lookup timeout.
    pub timeout: Duration,
    /// Empty means the system resolver configuration.
    pub nameservers: Vec<SocketAddr>,
    /// Consecutive failed lookups before the verdict is "unresolvable".
    pub failure_threshold: u32,
    /// Longest time a looked-up record is trusted, whatever its TTL says.
    pub ttl_cap: Duration,
}

/// How to find and stop etcd in the shared PID namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KillConfig {
    pub process_name: String,
    pub cmdline_contains: Option<String>,
    pub grace: Duration,
}

/// The HTTP server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// Bearer token required by mutating endpoints, when set.
    pub token: Option<Secret>,
    pub tls: Option<(PathBuf, PathBuf)>,
}

/// Restoring a data directory from the store (`restore`, and `serve` with `initialize`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreConfig {
    /// The data directory to create; required by `restore` and by `initialize`.
    pub data_dir: Option<PathBuf>,
    pub name: String,
    /// `name=peerURL,...`; empty means this member alone.
    pub initial_cluster: String,
    pub initial_cluster_token: String,
    pub initial_advertise_peer_urls: String,
    /// Directory of `etcd` and `etcdutl`/`etcdctl`; `None` searches `PATH`.
    pub etcd_bin: Option<PathBuf>,
    /// Deltas fetched ahead of the one being replayed (at least 1).
    pub parallel_fetch: usize,
    /// Move a non-empty data directory aside instead of refusing.
    pub force: bool,
    /// `serve` restores a missing or invalid data directory before it starts.
    pub initialize: bool,
    /// Written next to the data directory; a different value there refuses to restore.
    pub guard: Option<String>,
}

/// Log output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogConfig {
    pub format: LogFormat,
    /// An `EnvFilter` directive such as `info` or `etcd_warden=debug,info`.
    pub level: String,
}

/// Human-readable or JSON lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Human,
    Json,
}

// ---------------------------------------------------------------------------------------------
// Loading.
// ---------------------------------------------------------------------------------------------

/// The layers merged into one table, with where each key's value came from.
struct Merged {
    table: toml::Table,
    origins: BTreeMap<String, String>,
}

impl Merged {
    fn origin_of(&self, key: &str) -> String {
        // A key's own origin, else its section's (an override of a whole table).
        let mut k = key;
        loop {
            if let Some(o) = self.origins.get(k) {
                return format!(" (from {o})");
            }
            match k.rsplit_once('.') {
                Some((parent, _)) => k = parent,
                None => return String::new(),
            }
        }
    }

    fn err(&self, key: &str, message: impl Into<String>) -> ConfigError {
        ConfigError {
            key: key.into(),
            origin: self.origin_of(key),
            message: message.into(),
        }
    }

    fn set(&mut self, key: &str, value: toml::Value, origin: String) -> Result<(), ConfigError> {
        let parts: Vec<&str> = key.split('.').collect();
        let (leaf, sections) = parts.split_last().expect("split yields at least one part");
        let mut table = &mut self.table;
        for (i, section) in sections.iter().enumerate() {
            let entry = table
                .entry(section.to_string())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            table = entry.as_table_mut().ok_or_else(|| {
                ConfigError::new(parts[..=i].join("."), "is a value, not a section")
            })?;
        }
        table.insert(leaf.to_string(), value);
        self.origins.insert(key.to_string(), origin);
        Ok(())
    }
}

fn merge(into: &mut toml::Table, from: toml::Table) {
    for (k, v) in from {
        match (into.get_mut(&k), v) {
            (Some(toml::Value::Table(dst)), toml::Value::Table(src)) => merge(dst, src),
            (_, v) => {
                into.insert(k, v);
            }
        }
    }
}

/// Sections a `ETCD_WARDEN_<SECTION>_<KEY>` variable can name.
const SECTIONS: &[&str] = &[
    "etcd",
    "store",
    "source_store",
    "copy",
    "snapshot",
    "owner",
    "kill",
    "server",
    "log",
    "restore",
];

/// Maps `ETCD_WARDEN_SNAPSHOT_DELTA_PERIOD` to `snapshot.delta_period`.
fn env_key(var: &str) -> Option<String> {
    let rest = var.strip_prefix(ENV_PREFIX)?.to_ascii_lowercase();
    // The longest matching section wins, so a section named like another's prefix (`store`,
    // `store_x`) cannot capture its variables.
    SECTIONS
        .iter()
        .filter_map(|s| {
            let key = rest.strip_prefix(s)?.strip_prefix('_')?;
            (!key.is_empty()).then(|| (s.len(), format!("{s}.{key}")))
        })
        .max_by_key(|(len, _)| *len)
        .map(|(_, key)| key)
}

/// The environment variable that sets a dotted key.
pub fn env_var_for(key: &str) -> String {
    format!("{ENV_PREFIX}{}", key.replace('.', "_").to_ascii_uppercase())
}

impl RawConfig {
    /// Merges the layers and deserializes them; unknown keys and wrongly typed values fail here.
    pub fn load(sources: &Sources<'_>) -> Result<RawConfig, ConfigError> {
        Self::merge_layers(sources).and_then(|m| Self::from_merged(&m))
    }

    fn merge_layers(sources: &Sources<'_>) -> Result<Merged, ConfigError> {
        let table: toml::Table = DEFAULTS.parse().expect("embedded defaults are valid TOML");
        let mut merged = Merged {
            table,
            origins: BTreeMap::new(),
        };

        if let Some(path) = sources.file {
            let shown = path.display().to_string();
            let text = std::fs::read_to_string(path).map_err(|e| {
                ConfigError::new(format!("--config {shown}"), format!("cannot read: {e}"))
            })?;
            let file: toml::Table = text.parse().map_err(|e: toml::de::Error| {
                ConfigError::new(
                    shown.clone(),
                    format!("not valid TOML: {}", one_line(&e.to_string())),
                )
            })?;
            merge(&mut merged.table, file);
        }

        let mut vars = sources.env.vars();
        vars.sort();
        for (var, value) in vars {
            if !var.starts_with(ENV_PREFIX) || ENV_NOT_KEYS.contains(&var.as_str()) {
                continue;
            }
            let key = env_key(&var).ok_or_else(|| {
                ConfigError::new(
                    var.clone(),
                    format!(
                        "unknown environment variable (expected {ENV_PREFIX}<SECTION>_<KEY> with a section of {})",
                        SECTIONS.join(", ")
                    ),
                )
            })?;
            merged.set(&key, text_value(&value), var)?;
        }

        for o in &sources.overrides {
            merged.set(&o.key, text_value(&o.value), o.origin.clone())?;
        }
        Ok(merged)
    }

    fn from_merged(m: &Merged) -> Result<RawConfig, ConfigError> {
        let de = toml::Value::Table(m.table.clone());
        serde_path_to_error::deserialize::<_, RawConfig>(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner().to_string();
            let inner = one_line(&inner);
            // serde reports an unknown key at its section's path; name the key itself.
            if let Some(rest) = inner.strip_prefix("unknown field `") {
                let (field, expected) = rest.split_once('`').unwrap_or((rest, ""));
                let key = join_key(&path, field);
                let expected = expected.split(" in `").next().unwrap_or(expected);
                return m.err(
                    &key,
                    format!(
                        "unknown key{}",
                        expected.replace(", expected", "; expected")
                    ),
                );
            }
            if let Some(field) = inner.strip_prefix("missing field `") {
                let field = field.trim_end_matches('`');
                return m.err(&join_key(&path, field), "required value missing");
            }
            m.err(&path, inner)
        })
    }

    /// A copy with every secret value replaced by [`REDACTED`] (file paths are kept).
    pub fn redacted(&self) -> RawConfig {
        let mut c = self.clone();
        let hide = |s: &mut Option<String>| {
            if s.is_some() {
                *s = Some(REDACTED.into());
            }
        };
        hide(&mut c.etcd.password);
        hide(&mut c.store.access_key_id);
        hide(&mut c.store.secret_access_key);
        hide(&mut c.store.account_key);
        if let Some(s) = &mut c.source_store {
            hide(&mut s.access_key_id);
            hide(&mut s.secret_access_key);
            hide(&mut s.account_key);
        }
        hide(&mut c.server.token);
        c
    }

    /// The configuration as TOML, secrets redacted.
    pub fn to_redacted_toml(&self) -> String {
        toml::to_string_pretty(&self.redacted()).expect("configuration serializes to TOML")
    }
}

/// Text from the environment or a flag as a TOML value: an array when written as one, else text
/// (each key's deserializer parses text into its own type).
fn text_value(s: &str) -> toml::Value {
    let t = s.trim();
    if t.starts_with('[')
        && let Ok(table) = format!("v = {t}").parse::<toml::Table>()
        && let Some(v) = table.get("v")
    {
        return v.clone();
    }
    toml::Value::String(s.to_string())
}

/// The dotted key of `field` under `path`, as serde_path_to_error reports them (the path may
/// already end with the field).
fn join_key(path: &str, field: &str) -> String {
    if path == "." || path.is_empty() {
        field.to_string()
    } else if path == field || path.ends_with(&format!(".{field}")) {
        path.to_string()
    } else {
        format!("{path}.{field}")
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

impl Config {
    /// Loads every layer and validates the result.
    pub fn load(sources: &Sources<'_>) -> Result<(Config, RawConfig), ConfigError> {
        let merged = RawConfig::merge_layers(sources)?;
        let raw = RawConfig::from_merged(&merged)?;
        let config = Validator { m: &merged }.validate(&raw)?;
        Ok((config, raw))
    }
}

struct Validator<'a> {
    m: &'a Merged,
}

impl Validator<'_> {
    fn err(&self, key: &str, message: impl Into<String>) -> ConfigError {
        self.m.err(key, message)
    }

    fn duration(&self, key: &str, text: &str) -> Result<Duration, ConfigError> {
        humantime::parse_duration(text.trim()).map_err(|e| {
            self.err(
                key,
                format!("invalid duration {text:?} ({e}); write e.g. \"30s\", \"5m\", \"1h30m\""),
            )
        })
    }

    fn positive_duration(&self, key: &str, text: &str) -> Result<Duration, ConfigError> {
        let d = self.duration(key, text)?;
        if d.is_zero() {
            return Err(self.err(key, "must be greater than zero"));
        }
        Ok(d)
    }

    fn path(
        &self,
        key: &str,
        p: &Option<String>,
        must_exist: bool,
    ) -> Result<Option<PathBuf>, ConfigError> {
        let Some(p) = p else { return Ok(None) };
        if p.trim().is_empty() {
            return Err(self.err(key, "is empty; remove the key or give a path"));
        }
        let path = PathBuf::from(p);
        if must_exist && !path.is_file() {
            return Err(self.err(
                key,
                format!("file {p:?} does not exist or is not a regular file"),
            ));
        }
        Ok(Some(path))
    }

    /// A secret given as `key` or `key_file`, not both.
    fn secret(
        &self,
        key: &str,
        value: &Option<String>,
        file: &Option<String>,
    ) -> Result<Option<Secret>, ConfigError> {
        let file_key = format!("{key}_file");
        match (value, file) {
            (Some(_), Some(_)) => {
                Err(self.err(key, format!("both {key} and {file_key} are set; give one")))
            }
            (Some(v), None) => Ok(Some(Secret::Value(v.clone()))),
            (None, Some(_)) => {
                let path = self.path(&file_key, file, true)?.expect("checked Some");
                let secret = Secret::File(path);
                secret
                    .read()
                    .map_err(|e| self.err(&file_key, format!("cannot read: {e}")))?;
                Ok(Some(secret))
            }
            (None, None) => Ok(None),
        }
    }

    fn validate(&self, raw: &RawConfig) -> Result<Config, ConfigError> {
        Ok(Config {
            etcd: self.etcd(&raw.etcd)?,
            store: self.store("store", &raw.store)?,
            source_store: raw
                .source_store
                .as_ref()
                .map(|s| self.store("source_store", s))
                .transpose()?,
            copy: self.copy(&raw.copy)?,
            snapshot: self.snapshot(&raw.snapshot)?,
            owner: raw.owner.as_ref().map(|o| self.owner(o)).transpose()?,
            kill: self.kill(&raw.kill)?,
            server: self.server(&raw.server)?,
            log: self.log(&raw.log)?,
            restore: self.restore(&raw.restore)?,
        })
    }

    fn restore(&self, r: &RawRestore) -> Result<RestoreConfig, ConfigError> {
        let name = r.name.trim();
        if name.is_empty() {
            return Err(self.err("restore.name", "required value missing"));
        }
        if r.parallel_fetch == 0 {
            return Err(self.err("restore.parallel_fetch", "must be at least 1"));
        }
        for member in r
            .initial_cluster
            .split(',')
            .filter(|m| !m.trim().is_empty())
        {
            if !member.contains('=') {
                return Err(self.err(
                    "restore.initial_cluster",
                    format!("{member:?} is not name=peerURL"),
                ));
            }
        }
        let data_dir = r
            .data_dir
            .as_deref()
            .filter(|d| !d.trim().is_empty())
            .map(PathBuf::from);
        Ok(RestoreConfig {
            data_dir,
            name: name.to_string(),
            initial_cluster: r.initial_cluster.trim().to_string(),
            initial_cluster_token: r.initial_cluster_token.clone(),
            initial_advertise_peer_urls: r.initial_advertise_peer_urls.clone(),
            etcd_bin: r
                .etcd_bin
                .as_deref()
                .filter(|d| !d.trim().is_empty())
                .map(PathBuf::from),
            parallel_fetch: usize::try_from(r.parallel_fetch).unwrap_or(usize::MAX),
            force: r.force,
            initialize: r.initialize,
            guard: r.guard.clone().filter(|g| !g.is_empty()),
        })
    }

    fn etcd(&self, e: &RawEtcd) -> Result<EtcdConfig, ConfigError> {
        if e.endpoints.is_empty() {
            return Err(self.err(
                "etcd.endpoints",
                "required value missing: give at least one endpoint",
            ));
        }
        let mut any_https = false;
        for ep in &e.endpoints {
            let url = url::Url::parse(ep).map_err(|err| {
                self.err(
                    "etcd.endpoints",
                    format!("{ep:?} is not a URL ({err}); write e.g. \"http://127.0.0.1:2379\""),
                )
            })?;
            match url.scheme() {
                "http" => {}
                "https" => any_https = true,
                other => {
                    return Err(self.err(
                        "etcd.endpoints",
                        format!("{ep:?}: scheme {other:?} is not http or https"),
                    ));
                }
            }
            if url.host_str().is_none() || url.port_or_known_default().is_none() {
                return Err(self.err("etcd.endpoints", format!("{ep:?} has no host or port")));
            }
        }
        let tls = TlsFiles {
            ca_file: self.path("etcd.ca_file", &e.ca_file, true)?,
            cert_file: self.path("etcd.cert_file", &e.cert_file, true)?,
            key_file: self.path("etcd.key_file", &e.key_file, true)?,
        };
        if tls.cert_file.is_some() != tls.key_file.is_some() {
            let missing = if tls.cert_file.is_some() {
                "etcd.key_file"
            } else {
                "etcd.cert_file"
            };
            return Err(self.err(
                missing,
                "required when the other half of the client certificate is set",
            ));
        }
        let has_tls = tls.ca_file.is_some() || tls.cert_file.is_some();
        if has_tls && !any_https {
            return Err(self.err(
                "etcd.endpoints",
                "TLS files are set but no endpoint is https://",
            ));
        }
        let password = self.secret("etcd.password", &e.password, &e.password_file)?;
        if password.is_some() != e.username.is_some() {
            let missing = if password.is_some() {
                "etcd.username"
            } else {
                "etcd.password"
            };
            return Err(self.err(
                missing,
                "required when the other half of the credentials is set",
            ));
        }
        Ok(EtcdConfig {
            endpoints: e.endpoints.clone(),
            tls: has_tls.then_some(tls),
            username: e.username.clone(),
            password,
            connect_timeout: self.positive_duration("etcd.connect_timeout", &e.connect_timeout)?,
            request_timeout: self.positive_duration("etcd.request_timeout", &e.request_timeout)?,
        })
    }

    /// Validates a store section (`store`, or another section of the same shape).
    fn store(&self, section: &str, s: &RawStore) -> Result<StoreConfig, ConfigError> {
        let key = |k: &str| format!("{section}.{k}");
        let location =
            StoreLocation::parse(&s.url).map_err(|e| self.err(&key("url"), e.to_string()))?;
        if let Some(ep) = &s.endpoint {
            url::Url::parse(ep)
                .map_err(|e| self.err(&key("endpoint"), format!("{ep:?} is not a URL ({e})")))?;
        }
        let allow_http = s.allow_http.unwrap_or_else(|| {
            s.endpoint
                .as_deref()
                .is_some_and(|e| e.starts_with("http://"))
        });
        Ok(StoreConfig {
            location,
            endpoint: s.endpoint.clone(),
            region: s.region.clone(),
            path_style: s.path_style,
            allow_http,
            access_key_id: self.secret(
                &key("access_key_id"),
                &s.access_key_id,
                &s.access_key_id_file,
            )?,
            secret_access_key: self.secret(
                &key("secret_access_key"),
                &s.secret_access_key,
                &s.secret_access_key_file,
            )?,
            service_account_file: self.path(
                &key("service_account_file"),
                &s.service_account_file,
                true,
            )?,
            account_name: s.account_name.clone(),
            account_key: self.secret(&key("account_key"), &s.account_key, &s.account_key_file)?,
            use_emulator: s.use_emulator,
        })
    }

    fn copy(&self, c: &RawCopy) -> Result<CopyConfig, ConfigError> {
        let max_age = match c.max_age.trim() {
            "" => None,
            text => Some(self.positive_duration("copy.max_age", text)?),
        };
        let parallel = usize::try_from(c.parallel)
            .ok()
            .filter(|n| (1..=1000).contains(n))
            .ok_or_else(|| self.err("copy.parallel", "must be between 1 and 1000"))?;
        Ok(CopyConfig {
            wait_for_final: c.wait_for_final,
            final_timeout: self.duration("copy.final_timeout", &c.final_timeout)?,
            poll_interval: self.positive_duration("copy.poll_interval", &c.poll_interval)?,
            max_backups: c.max_backups,
            max_age,
            parallel,
        })
    }

    fn snapshot(&self, s: &RawSnapshot) -> Result<SnapshotConfig, ConfigError> {
        let schedule = croner::Cron::from_str(s.schedule.trim()).map_err(|e| {
            self.err(
                "snapshot.schedule",
                format!(
                    "invalid cron expression {:?} ({e}); write e.g. \"0 */1 * * *\"",
                    s.schedule
                ),
            )
        })?;
        let compression = match s.compression.trim().to_ascii_lowercase().as_str() {
            "none" | "" => Compression::None,
            "gzip" | "gz" => Compression::Gzip,
            "zlib" => Compression::Zlib,
            other => {
                return Err(self.err(
                    "snapshot.compression",
                    format!("unknown compression {other:?}; one of gzip, zlib, none"),
                ));
            }
        };
        let gc_policy = match s.gc_policy.trim() {
            "LimitBased" => {
                if s.max_backups == 0 {
                    return Err(self.err(
                        "snapshot.max_backups",
                        "must be at least 1 with gc_policy = \"LimitBased\"",
                    ));
                }
                GcPolicy::LimitBased {
                    max_backups: s.max_backups,
                }
            }
            "Exponential" => GcPolicy::Exponential,
            other => {
                return Err(self.err(
                    "snapshot.gc_policy",
                    format!("unknown policy {other:?}; one of LimitBased, Exponential"),
                ));
            }
        };
        Ok(SnapshotConfig {
            schedule,
            delta_period: self.duration("snapshot.delta_period", &s.delta_period)?,
            delta_memory_limit: parse_bytes(&s.delta_memory_limit)
                .map_err(|m| self.err("snapshot.delta_memory_limit", m))?,
            compression,
            gc_policy,
            gc_period: self.positive_duration("snapshot.gc_period", &s.gc_period)?,
            delta_retention: self.duration("snapshot.delta_retention", &s.delta_retention)?,
            leader_check_interval: self
                .positive_duration("snapshot.leader_check_interval", &s.leader_check_interval)?,
        })
    }

    fn owner(&self, o: &RawOwner) -> Result<OwnerConfig, ConfigError> {
        if o.name.trim().is_empty() {
            return Err(self.err(
                "owner.name",
                "required value missing: the owner DNS record's name",
            ));
        }
        if o.id.trim().is_empty() {
            return Err(self.err("owner.id", "required value missing: this seed's owner ID"));
        }
        let nameservers = o
            .nameservers
            .iter()
            .map(|ns| {
                parse_nameserver(ns).ok_or_else(|| {
                    self.err(
                        "owner.nameservers",
                        format!(
                            "{ns:?} is not an IP address with optional port, e.g. \"10.0.0.10:53\""
                        ),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let failure_threshold = u32::try_from(o.failure_threshold)
            .ok()
            .filter(|n| *n >= 1)
            .ok_or_else(|| {
                self.err(
                    "owner.failure_threshold",
                    "must be between 1 and 4294967295",
                )
            })?;
        Ok(OwnerConfig {
            name: o.name.trim().to_string(),
            id: o.id.clone(),
            interval: self.positive_duration("owner.interval", &o.interval)?,
            timeout: self.positive_duration("owner.timeout", &o.timeout)?,
            nameservers,
            failure_threshold,
            ttl_cap: self.duration("owner.ttl_cap", &o.ttl_cap)?,
        })
    }

    fn kill(&self, k: &RawKill) -> Result<KillConfig, ConfigError> {
        let name = k.process_name.trim();
        if name.is_empty() {
            return Err(self.err("kill.process_name", "required value missing"));
        }
        // The kernel keeps 15 bytes of a process name in /proc/<pid>/comm.
        if name.len() > 15 {
            return Err(self.err("kill.process_name", format!("{name:?} is longer than the 15 bytes the kernel keeps in /proc/<pid>/comm; use kill.cmdline_contains for the rest")));
        }
        Ok(KillConfig {
            process_name: name.to_string(),
            cmdline_contains: k.cmdline_contains.clone().filter(|s| !s.is_empty()),
            grace: self.duration("kill.grace", &k.grace)?,
        })
    }

    fn server(&self, s: &RawServer) -> Result<ServerConfig, ConfigError> {
        let listen = s.listen.trim().parse().map_err(|_| {
            self.err(
                "server.listen",
                format!(
                    "{:?} is not an address with a port, e.g. \"0.0.0.0:8080\"",
                    s.listen
                ),
            )
        })?;
        let cert = self.path("server.tls_cert_file", &s.tls_cert_file, true)?;
        let key = self.path("server.tls_key_file", &s.tls_key_file, true)?;
        let tls = match (cert, key) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            (Some(_), None) => {
                return Err(self.err(
                    "server.tls_key_file",
                    "required when server.tls_cert_file is set",
                ));
            }
            (None, Some(_)) => {
                return Err(self.err(
                    "server.tls_cert_file",
                    "required when server.tls_key_file is set",
                ));
            }
        };
        Ok(ServerConfig {
            listen,
            token: self.secret("server.token", &s.token, &s.token_file)?,
            tls,
        })
    }

    fn log(&self, l: &RawLog) -> Result<LogConfig, ConfigError> {
        let format = match l.format.trim().to_ascii_lowercase().as_str() {
            "human" | "text" => LogFormat::Human,
            "json" => LogFormat::Json,
            other => {
                return Err(self.err(
                    "log.format",
                    format!("unknown format {other:?}; one of human, json"),
                ));
            }
        };
        tracing_subscriber::EnvFilter::try_new(l.level.trim())
            .map_err(|e| self.err("log.level", format!("invalid level {:?} ({e})", l.level)))?;
        Ok(LogConfig {
            format,
            level: l.level.trim().to_string(),
        })
    }
}

/// An IP address with an optional port (53 when absent).
fn parse_nameserver(s: &str) -> Option<SocketAddr> {
    let s = s.trim();
    s.parse::<SocketAddr>().ok().or_else(|| {
        s.parse::<std::net::IpAddr>()
            .ok()
            .map(|ip| SocketAddr::new(ip, 53))
    })
}

/// Parses a byte size: `1048576`, `512KiB`, `100MiB`, `1GiB`, `10MB`.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
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
    fn env_keys_map_to_sections() {
        assert_eq!(
            env_key("ETCD_WARDEN_SNAPSHOT_DELTA_PERIOD").as_deref(),
            Some("snapshot.delta_period")
        );
        assert_eq!(env_key("ETCD_WARDEN_OWNER_ID").as_deref(), Some("owner.id"));
        assert_eq!(
            env_key("ETCD_WARDEN_STORE_URL").as_deref(),
            Some("store.url")
        );
        assert_eq!(env_key("ETCD_WARDEN_STORE"), None);
        assert_eq!(env_key("ETCD_WARDEN_NOPE_X"), None);
        assert_eq!(
            env_var_for("snapshot.delta_period"),
            "ETCD_WARDEN_SNAPSHOT_DELTA_PERIOD"
        );
    }

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

    #[test]
    fn text_values_become_arrays_only_when_written_as_one() {
        assert_eq!(
            text_value("[\"a\", \"b\"]"),
            toml::Value::Array(vec!["a".into(), "b".into()])
        );
        assert_eq!(text_value("30s"), toml::Value::String("30s".into()));
        assert_eq!(text_value("[broken"), toml::Value::String("[broken".into()));
    }
}
