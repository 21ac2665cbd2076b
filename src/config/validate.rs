//! Validation: the raw layer checked section by section into the immutable [`Config`]. Every
//! error names the dotted key at fault and, through [`Merged`], where its value came from.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use super::keys::parse_recipient;

/// A delta's trailing SHA-256: the least a delta's payload can be.
const HASH_BYTES: u64 = 32;
use super::merge::Merged;
use super::raw::{
    RawConfig, RawCopy, RawDefrag, RawDruid, RawEncryption, RawEtcd, RawKill, RawKubernetes,
    RawLog, RawOwner, RawQuorumRestore, RawRestore, RawServer, RawSnapshot, RawStore, parse_bytes,
    parse_duration, parse_nameserver,
};
use super::{
    AzureWorkloadIdentity, Compression, Config, ConfigError, CopyConfig, DefragConfig, DruidConfig,
    EncryptionConfig, EtcdConfig, GcPolicy, KillConfig, KubernetesConfig, LogConfig, LogFormat,
    ObjectLockMode, ObjectLockRetention, OwnerConfig, PeerTls, Purpose, QuorumRestoreConfig,
    ReadLimits, RestoreConfig, SecondaryConfig, Secret, ServerConfig, ServerSideEncryption,
    SnapshotConfig, StoreConfig, StoreLocation, TlsFiles, Validation, WebIdentity,
};

/// The spellings of each compression, the one errors list first.
const COMPRESSIONS: &[(&[&str], Compression)] = &[
    (&["gzip", "gz"], Compression::Gzip),
    (&["zlib"], Compression::Zlib),
    (&["none", ""], Compression::None),
];

/// `store.secondary.max_lag` when not given: several sync intervals, so one slow copy of a
/// large full snapshot does not page anyone.
const SECONDARY_MAX_LAG: &str = "15m";
/// `store.secondary.sync_interval` when not given.
const SECONDARY_SYNC_INTERVAL: &str = "10s";

/// The spellings of each log format, the one errors list first.
const LOG_FORMATS: &[(&[&str], LogFormat)] = &[
    (&["human", "text"], LogFormat::Human),
    (&["json"], LogFormat::Json),
];

/// Validates `raw` for `purpose`; `merged` says where each value came from.
pub(super) fn validate(
    raw: &RawConfig,
    merged: &Merged,
    purpose: Purpose,
) -> Result<Config, ConfigError> {
    let v = Validator { m: merged };
    let config = v.validate(raw)?;
    v.purpose(&config, purpose)?;
    Ok(config)
}

struct Validator<'a> {
    m: &'a Merged,
}

impl Validator<'_> {
    /// `text` (the value of `key`) as a URL; an error names the key, never repeating a user
    /// name or password, and a URL that holds one is refused ([`super::location`]).
    fn url(&self, key: &str, text: &str) -> Result<url::Url, ConfigError> {
        let shown = super::redact_url(text);
        let url = url::Url::parse(text)
            .map_err(|e| self.err(key, format!("{shown:?} is not a URL ({e})")))?;
        if super::location::has_userinfo(&url) {
            return Err(self.err(
                key,
                format!("{shown:?} {}", super::location::CREDENTIALS_IN_URL),
            ));
        }
        Ok(url)
    }

    fn err(&self, key: &str, message: impl Into<String>) -> ConfigError {
        self.m.err(key, message)
    }

    /// The value `text` names, case and surrounding space ignored. Each of `names` is a value's
    /// spellings, the first of which the error lists.
    fn one_of<T: Copy>(
        &self,
        key: &str,
        text: &str,
        names: &[(&[&str], T)],
    ) -> Result<T, ConfigError> {
        // "snapshot.compression" asks for a compression.
        let what = key.rsplit('.').next().unwrap_or(key);
        let text = text.trim().to_ascii_lowercase();
        let found = names
            .iter()
            .find(|(spellings, _)| spellings.contains(&text.as_str()));
        found.map(|&(_, value)| value).ok_or_else(|| {
            let listed: Vec<&str> = names.iter().map(|(spellings, _)| spellings[0]).collect();
            self.err(
                key,
                format!("unknown {what} {text:?}; one of {}", listed.join(", ")),
            )
        })
    }

    fn duration(&self, key: &str, text: &str) -> Result<Duration, ConfigError> {
        parse_duration(text).map_err(|m| self.err(key, m))
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
                format!(
                    "file {} does not exist or is not a regular file",
                    super::keys::shown(p)
                ),
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
        let etcd = self.etcd(&raw.etcd)?;
        let snapshot = self.snapshot(&raw.snapshot)?;
        let config = Config {
            restore: self.restore(&raw.restore, &etcd, &snapshot)?,
            etcd,
            store: self.store("store", &raw.store)?,
            secondary: raw
                .store
                .secondary
                .as_deref()
                .map(|s| self.secondary(s))
                .transpose()?,
            source_store: raw
                .source_store
                .as_ref()
                .map(|s| self.store("source_store", s))
                .transpose()?,
            copy: self.copy(&raw.copy)?,
            snapshot,
            defrag: self.defrag(&raw.defrag)?,
            owner: raw.owner.as_ref().map(|o| self.owner(o)).transpose()?,
            kill: self.kill(&raw.kill)?,
            server: self.server(&raw.server)?,
            log: self.log(&raw.log)?,
            quorum_restore: self.quorum_restore(&raw.quorum_restore)?,
            encryption: self.encryption(raw.encryption.as_ref())?,
            druid: raw.druid.as_ref().map(|d| self.druid(d)).transpose()?,
            kubernetes: raw
                .kubernetes
                .as_ref()
                .map(|k| self.kubernetes(k))
                .transpose()?,
        };
        self.owner_endpoints(&config)?;
        Ok(config)
    }

    /// With `[owner]`, etcd must be this pod's member alone: the watchdog reads the member ID it
    /// fences under, and the final's revision, from whichever endpoint answers, so with several
    /// it could mark another (still serving) member fenced instead of the one it killed, or
    /// stream the final from a member lagging behind the frozen revision.
    fn owner_endpoints(&self, c: &Config) -> Result<(), ConfigError> {
        if c.owner.is_none() || c.etcd.endpoints.len() <= 1 {
            return Ok(());
        }
        Err(self.err(
            "etcd.endpoints",
            format!(
                "{} endpoints ({}) with [owner] set: give only this pod's own member \
                 (e.g. \"http://127.0.0.1:2379\"); the ownership watchdog fences the member that \
                 answers and must be the one whose etcd it kills, and the final snapshot must come \
                 from it",
                c.etcd.endpoints.len(),
                c.etcd.endpoints.join(", ")
            ),
        ))
    }

    /// What `purpose` needs beyond what every use needs: values that are optional in general
    /// but required by one subcommand.
    fn purpose(&self, c: &Config, purpose: Purpose) -> Result<(), ConfigError> {
        match purpose {
            Purpose::Copy if c.source_store.is_none() => Err(self.err(
                "source_store.url",
                "required for copy: give --source-store URL",
            )),
            Purpose::Restore if c.restore.data_dir.is_none() => Err(self.err(
                "restore.data_dir",
                "required value missing: give --data-dir",
            )),
            // Other subcommands never bind the server, so only `serve` needs the token.
            Purpose::Serve
                if c.server.token.is_none()
                    && c.server.client_ca.is_none()
                    && !c.server.unauthenticated_snapshots
                    && !c.server.loopback_only() =>
            {
                Err(self.err(
                    "server.token",
                    format!(
                        "required when server.listen{} = \"{}\" is not a loopback address, or \
                         anyone who reaches the port can POST /snapshot/*: set server.token or \
                         server.token_file (or server.tls_client_ca_file, for mutual TLS), or \
                         listen on 127.0.0.1",
                        self.m.origin_of("server.listen"),
                        c.server.listen
                    ),
                ))
            }
            Purpose::Serve if c.druid.as_ref().is_some_and(|d| d.pod_name.is_none()) => Err(self
                .err(
                    "druid.pod_name",
                    "required value missing: the member's name is derived from the pod's \
                     (POD_NAME)",
                )),
            Purpose::Any | Purpose::Serve | Purpose::Copy | Purpose::Restore => Ok(()),
        }
    }

    fn restore(
        &self,
        r: &RawRestore,
        etcd: &EtcdConfig,
        snapshot: &SnapshotConfig,
    ) -> Result<RestoreConfig, ConfigError> {
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
        let validation = match r.validation.trim().to_ascii_lowercase().as_str() {
            "sanity" => Validation::Sanity,
            "full" => Validation::Full,
            _ => {
                return Err(self.err(
                    "restore.validation",
                    format!("unknown mode {:?}; one of sanity, full", r.validation),
                ));
            }
        };
        let peer_tls = self.peer_tls(r)?;
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
            validation,
            fallback: r.fallback,
            guard: r.guard.clone().filter(|g| !g.is_empty()),
            work_dir: r
                .work_dir
                .as_deref()
                .filter(|d| !d.trim().is_empty())
                .map(PathBuf::from),
            cluster: self.rejoin_cluster(r, etcd, peer_tls.is_some())?,
            rejoin_timeout: self.positive_duration("restore.rejoin_timeout", &r.rejoin_timeout)?,
            peer_tls,
            bump_revision: self.bump_revision(r)?,
            mark_compacted: r.mark_compacted,
            read_limits: self.read_limits(r, snapshot)?,
        })
    }

    /// `restore.max_delta_size` (empty: derived from `snapshot.delta_memory_limit`) and
    /// `restore.max_inflation_ratio`.
    fn read_limits(
        &self,
        r: &RawRestore,
        snapshot: &SnapshotConfig,
    ) -> Result<ReadLimits, ConfigError> {
        let max_delta_size = match r.max_delta_size.trim() {
            "" => ReadLimits::delta_size_for(snapshot.delta_memory_limit),
            text => parse_bytes(text).map_err(|m| self.err("restore.max_delta_size", m))?,
        };
        if max_delta_size < HASH_BYTES {
            return Err(self.err(
                "restore.max_delta_size",
                format!("{max_delta_size} bytes cannot hold even a delta's hash"),
            ));
        }
        if r.max_inflation_ratio == 0 {
            return Err(self.err("restore.max_inflation_ratio", "must be at least 1"));
        }
        Ok(ReadLimits {
            max_delta_size,
            max_inflation_ratio: r.max_inflation_ratio,
            min_full_bound: ReadLimits::MIN_FULL_BOUND,
        })
    }

    /// `restore.bump_revision`, checked with `restore.mark_compacted`: marking compacted without
    /// a bump would compact the restored data's own last revision (etcdutl refuses it too), and
    /// a bump beyond 2^62 leaves etcd no room to count.
    fn bump_revision(&self, r: &RawRestore) -> Result<u64, ConfigError> {
        if r.mark_compacted && r.bump_revision == 0 {
            return Err(self.err(
                "restore.mark_compacted",
                "needs restore.bump_revision above 0 (--bump-revision N)".to_string(),
            ));
        }
        if r.bump_revision > 1 << 62 {
            return Err(self.err(
                "restore.bump_revision",
                format!(
                    "{} is above 2^62; etcd counts revisions in 63 bits",
                    r.bump_revision
                ),
            ));
        }
        Ok(r.bump_revision)
    }

    /// `restore.cluster_endpoints` as a client configuration with `[etcd]`'s TLS material,
    /// credentials and timeouts; `None` when empty. With `https://` peer URLs the rejoining
    /// member's temporary etcd needs this member's peer certificate (`has_peer_tls`).
    fn rejoin_cluster(
        &self,
        r: &RawRestore,
        etcd: &EtcdConfig,
        has_peer_tls: bool,
    ) -> Result<Option<EtcdConfig>, ConfigError> {
        let key = "restore.cluster_endpoints";
        let endpoints: Vec<String> = r
            .cluster_endpoints
            .iter()
            .map(|e| e.trim().to_string())
            .filter(|e| !e.is_empty())
            .collect();
        if endpoints.is_empty() {
            return Ok(None);
        }
        for ep in &endpoints {
            let url = url::Url::parse(ep).map_err(|err| {
                self.err(
                    key,
                    format!("{ep:?} is not a URL ({err}); write e.g. \"http://etcd-0.etcd:2379\""),
                )
            })?;
            if !matches!(url.scheme(), "http" | "https") {
                return Err(self.err(
                    key,
                    format!("{ep:?}: scheme {:?} is not http or https", url.scheme()),
                ));
            }
            if url.host_str().is_none() || url.port_or_known_default().is_none() {
                return Err(self.err(key, format!("{ep:?} has no host or port")));
            }
        }
        for peer in r.initial_advertise_peer_urls.split(',').map(str::trim) {
            let scheme = url::Url::parse(peer).map(|u| u.scheme().to_string());
            match scheme.as_deref() {
                Ok("http") => {}
                Ok("https") if has_peer_tls => {}
                Ok("https") => {
                    return Err(self.err(
                        "restore.peer_cert_file",
                        format!(
                            "required with {key} set and the peer URL {peer:?} \
                             (restore.initial_advertise_peer_urls): a rejoining member's temporary \
                             etcd speaks TLS to the other members with this member's peer \
                             certificate (restore.peer_cert_file, restore.peer_key_file)"
                        ),
                    ));
                }
                _ => {
                    return Err(self.err(
                        "restore.initial_advertise_peer_urls",
                        format!(
                            "{peer:?}: with {key} set, each peer URL must be http:// or https://"
                        ),
                    ));
                }
            }
        }
        Ok(Some(EtcdConfig {
            endpoints,
            ..etcd.clone()
        }))
    }

    /// `restore.peer_cert_file`, `restore.peer_key_file`, `restore.peer_ca_file` and
    /// `restore.peer_client_cert_auth`: both halves of the certificate or neither, and a CA to
    /// check the other members' certificates against when they must present one.
    fn peer_tls(&self, r: &RawRestore) -> Result<Option<PeerTls>, ConfigError> {
        let cert = self.path("restore.peer_cert_file", &r.peer_cert_file, true)?;
        let key = self.path("restore.peer_key_file", &r.peer_key_file, true)?;
        let ca_file = self.path("restore.peer_ca_file", &r.peer_ca_file, true)?;
        let (cert_file, key_file) = match (cert, key) {
            (Some(c), Some(k)) => (c, k),
            (Some(_), None) => {
                return Err(self.err(
                    "restore.peer_key_file",
                    "required when restore.peer_cert_file is set",
                ));
            }
            (None, Some(_)) => {
                return Err(self.err(
                    "restore.peer_cert_file",
                    "required when restore.peer_key_file is set",
                ));
            }
            (None, None) if ca_file.is_some() => {
                return Err(self.err(
                    "restore.peer_cert_file",
                    "required when restore.peer_ca_file is set: etcd speaks peer TLS only with \
                     a certificate",
                ));
            }
            (None, None) => return Ok(None),
        };
        if r.peer_client_cert_auth && ca_file.is_none() {
            return Err(self.err(
                "restore.peer_ca_file",
                "required with restore.peer_client_cert_auth = true (the default): the other \
                 members' certificates are checked against it; set peer_client_cert_auth = false \
                 only when the cluster's members run without --peer-client-cert-auth",
            ));
        }
        Ok(Some(PeerTls {
            cert_file,
            key_file,
            ca_file,
            client_cert_auth: r.peer_client_cert_auth,
        }))
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

    /// `[store.secondary]`: a store section of its own plus the lag bound and the interval.
    fn secondary(&self, s: &RawStore) -> Result<SecondaryConfig, ConfigError> {
        const SECTION: &str = "store.secondary";
        if s.secondary.is_some() {
            return Err(self.err(
                "store.secondary.secondary",
                "a secondary store has no secondary of its own",
            ));
        }
        let store = self.store(SECTION, s)?;
        let max_lag = s.max_lag.as_deref().unwrap_or(SECONDARY_MAX_LAG);
        let sync_interval = s
            .sync_interval
            .as_deref()
            .unwrap_or(SECONDARY_SYNC_INTERVAL);
        Ok(SecondaryConfig {
            store,
            max_lag: self.positive_duration("store.secondary.max_lag", max_lag)?,
            sync_interval: self
                .positive_duration("store.secondary.sync_interval", sync_interval)?,
        })
    }

    /// Validates a store section (`store`, or another section of the same shape).
    fn store(&self, section: &str, s: &RawStore) -> Result<StoreConfig, ConfigError> {
        let key = |k: &str| format!("{section}.{k}");
        // The secondary's own keys, and a secondary itself, belong to `[store]` alone.
        if section != "store" && s.secondary.is_some() {
            return Err(self.err(
                &key("secondary"),
                "only [store] can have a secondary ([store.secondary])",
            ));
        }
        if section != "store.secondary" {
            for (k, v) in [("max_lag", &s.max_lag), ("sync_interval", &s.sync_interval)] {
                if v.is_some() {
                    return Err(self.err(
                        &key(k),
                        format!("belongs in [store.secondary] (store.secondary.{k})"),
                    ));
                }
            }
        }
        let location =
            StoreLocation::parse(&s.url).map_err(|e| self.err(&key("url"), e.to_string()))?;
        if let Some(ep) = &s.endpoint {
            self.url(&key("endpoint"), ep)?;
        }
        let allow_http = s.allow_http.unwrap_or_else(|| {
            s.endpoint
                .as_deref()
                .is_some_and(|e| e.starts_with("http://"))
        });
        let web_identity = self.web_identity(section, s, &location)?;
        let ca_file = self.ca_file(&key("ca_file"), &s.ca_file, &location)?;
        let sse = self.server_side_encryption(section, s, &location)?;
        let azure_identity = self.azure_identity(section, s, &location)?;
        let object_lock = self.object_lock(section, s, &location)?;
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
            private: s.private,
            web_identity,
            ca_file,
            sse,
            azure_identity,
            object_lock,
        })
    }

    /// `object_lock_retention` (a positive duration) and `object_lock_mode`, for S3 only: GCS
    /// and Azure keep objects by a bucket's or container's policy, which etcd-warden does not
    /// write per object.
    fn object_lock(
        &self,
        section: &str,
        s: &RawStore,
        location: &StoreLocation,
    ) -> Result<Option<ObjectLockRetention>, ConfigError> {
        let key = |k: &str| format!("{section}.{k}");
        let period = s
            .object_lock_retention
            .as_deref()
            .map(str::trim)
            .filter(|p| !p.is_empty());
        let Some(period) = period else {
            if s.object_lock_mode.is_some() {
                return Err(self.err(
                    &key("object_lock_mode"),
                    format!("needs {section}.object_lock_retention (how long to retain)"),
                ));
            }
            return Ok(None);
        };
        if !matches!(location, StoreLocation::S3 { .. }) {
            return Err(self.err(
                &key("object_lock_retention"),
                "is for s3:// stores: GCS retention policies and Azure immutability policies \
                 are set on the bucket or container (see docs/operations.md)",
            ));
        }
        let period = self.positive_duration(&key("object_lock_retention"), period)?;
        let mode = match s.object_lock_mode.as_deref().map(str::trim) {
            None | Some("") => ObjectLockMode::Governance,
            Some(m) if m.eq_ignore_ascii_case("governance") => ObjectLockMode::Governance,
            Some(m) if m.eq_ignore_ascii_case("compliance") => ObjectLockMode::Compliance,
            Some(m) => {
                return Err(self.err(
                    &key("object_lock_mode"),
                    format!("{m:?}: must be \"governance\" or \"compliance\""),
                ));
            }
        };
        Ok(Some(ObjectLockRetention { mode, period }))
    }

    /// `server_side_encryption` with its key (`sse_kms_key_id`, `sse_customer_key_file`), for S3.
    fn server_side_encryption(
        &self,
        section: &str,
        s: &RawStore,
        location: &StoreLocation,
    ) -> Result<Option<ServerSideEncryption>, ConfigError> {
        let key = |k: &str| format!("{section}.{k}");
        let Some(mode) = s.server_side_encryption.as_deref().map(str::trim) else {
            for (k, v) in [
                ("sse_kms_key_id", &s.sse_kms_key_id),
                ("sse_customer_key_file", &s.sse_customer_key_file),
            ] {
                if v.is_some() {
                    return Err(
                        self.err(&key(k), format!("needs {section}.server_side_encryption"))
                    );
                }
            }
            return Ok(None);
        };
        if !matches!(location, StoreLocation::S3 { .. }) {
            return Err(self.err(
                &key("server_side_encryption"),
                "is for s3:// stores (GCS and Azure encrypt at rest by the bucket's or account's \
                 settings; see docs/operations.md)",
            ));
        }
        let refuse = |k: &str, given: bool, why: &str| -> Result<(), ConfigError> {
            if given {
                Err(self.err(&key(k), why))
            } else {
                Ok(())
            }
        };
        let kms_key = s.sse_kms_key_id.is_some();
        let customer_key = s.sse_customer_key_file.is_some();
        let sse = match mode {
            "AES256" => {
                refuse("sse_kms_key_id", kms_key, "is for aws:kms and aws:kms:dsse")?;
                refuse("sse_customer_key_file", customer_key, "is for sse-c")?;
                ServerSideEncryption::S3Managed
            }
            "aws:kms" | "aws:kms:dsse" => {
                refuse("sse_customer_key_file", customer_key, "is for sse-c")?;
                let key_id = match s.sse_kms_key_id.as_deref().map(str::trim) {
                    None => None,
                    Some("") => {
                        return Err(self.err(
                            &key("sse_kms_key_id"),
                            "is empty; remove it to use the bucket's default KMS key",
                        ));
                    }
                    Some(k) => Some(k.to_string()),
                };
                ServerSideEncryption::Kms {
                    key_id,
                    dual: mode == "aws:kms:dsse",
                }
            }
            "sse-c" => {
                refuse("sse_kms_key_id", kms_key, "is for aws:kms and aws:kms:dsse")?;
                let file_key = key("sse_customer_key_file");
                let Some(file) = self.path(&file_key, &s.sse_customer_key_file, true)? else {
                    return Err(self.err(
                        &file_key,
                        "required with sse-c: the file holding the 256-bit key",
                    ));
                };
                let bytes = std::fs::read(&file)
                    .map_err(|e| self.err(&file_key, format!("{}: {e}", file.display())))?;
                let key_base64 = customer_key_base64(&bytes)
                    .map_err(|why| self.err(&file_key, format!("{}: {why}", file.display())))?;
                ServerSideEncryption::Customer { key_base64 }
            }
            other => {
                return Err(self.err(
                    &key("server_side_encryption"),
                    format!("{other:?} is not one of AES256, aws:kms, aws:kms:dsse, sse-c"),
                ));
            }
        };
        Ok(Some(sse))
    }

    /// `federated_token_file` with `client_id` and `tenant_id` (an Azure workload identity), and
    /// `authority_host`, for Azure.
    fn azure_identity(
        &self,
        section: &str,
        s: &RawStore,
        location: &StoreLocation,
    ) -> Result<Option<AzureWorkloadIdentity>, ConfigError> {
        let key = |k: &str| format!("{section}.{k}");
        let token_file = self.path(&key("federated_token_file"), &s.federated_token_file, false)?;
        let Some(token_file) = token_file else {
            for (k, v) in [
                ("client_id", &s.client_id),
                ("tenant_id", &s.tenant_id),
                ("authority_host", &s.authority_host),
            ] {
                if v.is_some() {
                    return Err(self.err(
                        &key(k),
                        format!(
                            "is for an Azure workload identity: needs \
                             {section}.federated_token_file"
                        ),
                    ));
                }
            }
            return Ok(None);
        };
        if !matches!(location, StoreLocation::Azure { .. }) {
            return Err(self.err(
                &key("federated_token_file"),
                "is for az:// stores (S3: role_arn and web_identity_token_file; GCS: see \
                 docs/operations.md)",
            ));
        }
        let required = |k: &str, v: &Option<String>| {
            given(v).ok_or_else(|| {
                self.err(
                    &key(k),
                    format!("required with {section}.federated_token_file"),
                )
            })
        };
        let client_id = required("client_id", &s.client_id)?;
        let tenant_id = required("tenant_id", &s.tenant_id)?;
        if s.account_key.is_some() || s.account_key_file.is_some() {
            return Err(self.err(
                &key("federated_token_file"),
                format!("give {section}.account_key or a workload identity, not both"),
            ));
        }
        let authority_host = match given(&s.authority_host).as_deref() {
            None => None,
            Some(host) => {
                let u = self.url(&key("authority_host"), host)?;
                if u.scheme() != "https" {
                    return Err(self.err(
                        &key("authority_host"),
                        format!(
                            "{:?}: Entra ID is only reached over https (the token is a \
                             credential)",
                            super::redact_url(host)
                        ),
                    ));
                }
                Some(host.trim_end_matches('/').to_string())
            }
        };
        Ok(Some(AzureWorkloadIdentity {
            client_id,
            tenant_id,
            token_file,
            authority_host,
        }))
    }

    /// `role_arn` with `web_identity_token_file` (both or neither), for S3, instead of keys.
    fn web_identity(
        &self,
        section: &str,
        s: &RawStore,
        location: &StoreLocation,
    ) -> Result<Option<WebIdentity>, ConfigError> {
        let key = |k: &str| format!("{section}.{k}");
        let role = s
            .role_arn
            .as_deref()
            .map(str::trim)
            .filter(|r| !r.is_empty());
        let token = self.path(
            &key("web_identity_token_file"),
            &s.web_identity_token_file,
            false,
        )?;
        let (role, token_file) = match (role, token) {
            (None, None) => {
                if s.sts_endpoint.is_some() {
                    return Err(self.err(
                        &key("sts_endpoint"),
                        format!("needs {section}.role_arn and {section}.web_identity_token_file"),
                    ));
                }
                return Ok(None);
            }
            (Some(r), Some(t)) => (r.to_string(), t),
            (Some(_), None) => {
                return Err(self.err(
                    &key("web_identity_token_file"),
                    format!("required with {section}.role_arn: the file the token is read from"),
                ));
            }
            (None, Some(_)) => {
                return Err(self.err(
                    &key("role_arn"),
                    format!("required with {section}.web_identity_token_file: the role to assume"),
                ));
            }
        };
        if !matches!(location, StoreLocation::S3 { .. }) {
            return Err(self.err(
                &key("role_arn"),
                "a web identity is for s3:// stores (GCS and Azure: see docs/operations.md)",
            ));
        }
        if s.access_key_id.is_some() || s.access_key_id_file.is_some() {
            return Err(self.err(
                &key("role_arn"),
                format!("give {section}.access_key_id or a web identity, not both"),
            ));
        }
        if let Some(ep) = &s.sts_endpoint {
            let u = self.url(&key("sts_endpoint"), ep)?;
            if u.scheme() != "https" {
                return Err(self.err(
                    &key("sts_endpoint"),
                    format!(
                        "{:?}: STS is only reached over https (the token is a credential)",
                        super::redact_url(ep)
                    ),
                ));
            }
        }
        Ok(Some(WebIdentity {
            role_arn: role,
            token_file,
            sts_endpoint: s.sts_endpoint.clone(),
        }))
    }

    /// A CA file that must exist and hold at least one PEM certificate.
    fn ca_file(
        &self,
        key: &str,
        value: &Option<String>,
        location: &StoreLocation,
    ) -> Result<Option<PathBuf>, ConfigError> {
        let Some(path) = self.path(key, value, true)? else {
            return Ok(None);
        };
        if matches!(
            location,
            StoreLocation::File { .. } | StoreLocation::Memory { .. }
        ) {
            return Err(self.err(key, "is for s3://, gs:// and az:// stores"));
        }
        let text = std::fs::read_to_string(&path)
            .map_err(|e| self.err(key, format!("{}: {e}", path.display())))?;
        if !text.contains("-----BEGIN CERTIFICATE-----") {
            return Err(self.err(key, format!("{} holds no PEM certificate", path.display())));
        }
        Ok(Some(path))
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
        if c.druid_final && !c.wait_for_final {
            return Err(self.err(
                "copy.druid_final",
                "true means \"the wait for the final also ends at etcd-druid's requested final\": \
                 set copy.wait_for_final = true too, or leave it false",
            ));
        }
        Ok(CopyConfig {
            wait_for_final: c.wait_for_final,
            druid_final: c.druid_final,
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
        let compression = self.one_of("snapshot.compression", &s.compression, COMPRESSIONS)?;
        let compression_level = u32::try_from(s.compression_level)
            .ok()
            .and_then(super::CompressionLevel::new)
            .ok_or_else(|| {
                self.err(
                    "snapshot.compression_level",
                    format!(
                        "{} is not a level; 1 (fastest, the default) to 9 (smallest)",
                        s.compression_level
                    ),
                )
            })?;
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
            compression_level,
            gc_policy,
            gc_period: self.positive_duration("snapshot.gc_period", &s.gc_period)?,
            delta_retention: self.duration("snapshot.delta_retention", &s.delta_retention)?,
            leader_check_interval: self
                .positive_duration("snapshot.leader_check_interval", &s.leader_check_interval)?,
            timeout: self.positive_duration("snapshot.timeout", &s.timeout)?,
        })
    }

    fn defrag(&self, d: &RawDefrag) -> Result<DefragConfig, ConfigError> {
        let text = d.schedule.trim();
        let schedule = if text.is_empty() {
            None
        } else {
            Some(croner::Cron::from_str(text).map_err(|e| {
                self.err(
                    "defrag.schedule",
                    format!(
                        "invalid cron expression {:?} ({e}); write e.g. \"0 3 * * 0\", or \"\" for off",
                        d.schedule
                    ),
                )
            })?)
        };
        let fraction = |key: &str, f: f64| {
            if (0.0..=1.0).contains(&f) {
                Ok(f)
            } else {
                Err(self.err(
                    key,
                    format!("{f} is not a fraction between 0 and 1 (e.g. 0.1 for 10% free)"),
                ))
            }
        };
        let check_interval = self.duration("defrag.check_interval", &d.check_interval)?;
        let disable_file = d.disable_file.trim();
        Ok(DefragConfig {
            schedule,
            timeout: self.positive_duration("defrag.timeout", &d.timeout)?,
            min_free_fraction: fraction("defrag.min_free_fraction", d.min_free_fraction)?,
            check_interval: (!check_interval.is_zero()).then_some(check_interval),
            trigger_min_db_size: parse_bytes(&d.trigger_min_db_size)
                .map_err(|m| self.err("defrag.trigger_min_db_size", m))?,
            trigger_min_free_fraction: fraction(
                "defrag.trigger_min_free_fraction",
                d.trigger_min_free_fraction,
            )?,
            disable_file: (!disable_file.is_empty()).then(|| PathBuf::from(disable_file)),
        })
    }

    fn owner(&self, o: &RawOwner) -> Result<OwnerConfig, ConfigError> {
        owner_config(o, &|key, message| self.err(key, message))
    }

    fn quorum_restore(&self, q: &RawQuorumRestore) -> Result<QuorumRestoreConfig, ConfigError> {
        Ok(QuorumRestoreConfig {
            lost_for: self.duration("quorum_restore.lost_for", &q.lost_for)?,
            probe_interval: self
                .positive_duration("quorum_restore.probe_interval", &q.probe_interval)?,
            machine: Some(q.machine.trim().to_owned()).filter(|m| !m.is_empty()),
            namespace: match q.namespace.trim() {
                "" => return Err(self.err("quorum_restore.namespace", "required value missing")),
                ns => ns.to_owned(),
            },
            kubeconfig: Some(q.kubeconfig.trim())
                .filter(|p| !p.is_empty())
                .map(PathBuf::from),
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
            settle: self.duration("kill.settle", &k.settle)?,
        })
    }

    fn kubernetes(&self, k: &RawKubernetes) -> Result<KubernetesConfig, ConfigError> {
        let required = |key: &str, value: &str| -> Result<String, ConfigError> {
            match value.trim() {
                "" => Err(self.err(key, "required value missing")),
                v => Ok(v.to_owned()),
            }
        };
        let owner = required("kubernetes.owner", &k.owner)?;
        // The owner prefixes object names (DNS subdomain names) and is a label value.
        let label_ok = owner.len() <= 63
            && owner
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && owner.starts_with(|c: char| c.is_ascii_alphanumeric())
            && owner.ends_with(|c: char| c.is_ascii_alphanumeric());
        if !label_ok {
            return Err(self.err(
                "kubernetes.owner",
                format!(
                    "{owner:?} is not a DNS label (at most 63 of a-z, 0-9 and '-', starting and ending with a letter or digit)"
                ),
            ));
        }
        Ok(KubernetesConfig {
            namespace: required("kubernetes.namespace", &k.namespace)?,
            owner,
            pod: required("kubernetes.pod", &k.pod)?,
            pod_uid: Some(k.pod_uid.trim().to_owned()).filter(|u| !u.is_empty()),
            kubeconfig: Some(k.kubeconfig.trim())
                .filter(|p| !p.is_empty())
                .map(PathBuf::from),
            inventory: k.inventory,
            inventory_interval: self
                .positive_duration("kubernetes.inventory_interval", &k.inventory_interval)?,
            events: k.events,
            request_timeout: self
                .positive_duration("kubernetes.request_timeout", &k.request_timeout)?,
        })
    }

    fn druid(&self, d: &RawDruid) -> Result<DruidConfig, ConfigError> {
        let pod_name = d
            .pod_name
            .as_deref()
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(str::to_string);
        let pod_namespace = d
            .pod_namespace
            .as_deref()
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(str::to_string);
        if (d.member_lease || d.snapshot_leases) && pod_namespace.is_none() {
            return Err(self.err(
                "druid.pod_namespace",
                "required value missing: the Leases are in the pod's namespace (POD_NAMESPACE)",
            ));
        }
        for (key, name) in [
            ("druid.full_snapshot_lease", &d.full_snapshot_lease),
            ("druid.delta_snapshot_lease", &d.delta_snapshot_lease),
        ] {
            if name.trim().is_empty() {
                return Err(self.err(key, "required value missing"));
            }
        }
        Ok(DruidConfig {
            etcd_config: PathBuf::from(d.etcd_config.trim()),
            pod_name,
            pod_namespace,
            member_lease: d.member_lease,
            heartbeat: self.positive_duration("druid.heartbeat", &d.heartbeat)?,
            snapshot_leases: d.snapshot_leases,
            full_snapshot_lease: d.full_snapshot_lease.trim().to_string(),
            delta_snapshot_lease: d.delta_snapshot_lease.trim().to_string(),
        })
    }

    fn server(&self, s: &RawServer) -> Result<ServerConfig, ConfigError> {
        let listen = s.listen.trim().parse().map_err(|_| {
            self.err(
                "server.listen",
                format!(
                    "{:?} is not an address with a port, e.g. \"127.0.0.1:8080\"",
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
        let token = self.secret("server.token", &s.token, &s.token_file)?;
        // An empty token matches no request (every POST would be 401) yet passes for "a token
        // is set": an unset variable or secret reference, not a choice. Only a set value is
        // checked here; a token file is read again on every request, for rotation.
        if let Some(Secret::Value(v)) = &token
            && v.trim().is_empty()
        {
            return Err(self.err(
                "server.token",
                "is empty; give the bearer token, set server.token_file, or remove the key \
                 (without a token, serve listens on loopback only)",
            ));
        }
        let client_ca = self.path("server.tls_client_ca_file", &s.tls_client_ca_file, true)?;
        if client_ca.is_some() && tls.is_none() {
            return Err(self.err(
                "server.tls_client_ca_file",
                "needs server.tls_cert_file and server.tls_key_file: client certificates are \
                 only asked for over TLS",
            ));
        }
        Ok(ServerConfig {
            listen,
            token,
            tls,
            client_ca,
            unauthenticated_snapshots: s.unauthenticated_snapshots,
            header_read_timeout: self
                .positive_duration("server.header_read_timeout", &s.header_read_timeout)?,
            request_timeout: self
                .positive_duration("server.request_timeout", &s.request_timeout)?,
            idle_timeout: self.positive_duration("server.idle_timeout", &s.idle_timeout)?,
            max_connections: match s.max_connections {
                0 => return Err(self.err("server.max_connections", "must be at least 1")),
                n => usize::try_from(n).unwrap_or(usize::MAX),
            },
            max_body_bytes: s.max_body_bytes,
        })
    }

    /// Every key parsed and every key file read once, so a typo stops the start and not the
    /// first snapshot (the files are read again on every use, for rotation).
    fn encryption(&self, e: Option<&RawEncryption>) -> Result<EncryptionConfig, ConfigError> {
        let Some(e) = e else {
            return Ok(EncryptionConfig::default());
        };
        let mut recipients = Vec::new();
        for (i, text) in e.recipients.iter().enumerate() {
            recipients.push(
                parse_recipient(text)
                    .map_err(|m| self.err(&format!("encryption.recipients[{i}]"), m))?,
            );
        }
        let files = |key: &str, paths: &[String]| -> Result<Vec<PathBuf>, ConfigError> {
            let mut out = Vec::new();
            for (i, p) in paths.iter().enumerate() {
                let at = format!("{key}[{i}]");
                out.push(
                    self.path(&at, &Some(p.clone()), true)?
                        .expect("checked Some"),
                );
            }
            Ok(out)
        };
        let config = EncryptionConfig {
            recipients,
            recipients_files: files("encryption.recipients_files", &e.recipients_files)?,
            identities: files("encryption.identities", &e.identities)?,
        };
        config
            .load_recipients()
            .map_err(|k| self.err("encryption.recipients_files", k.to_string()))?;
        config
            .load_identities()
            .map_err(|k| self.err("encryption.identities", k.to_string()))?;
        if !config.encrypts() && config.identities.is_empty() {
            return Err(self.err(
                "encryption",
                "the section is empty: set recipients or recipients_files (to encrypt new \
                 snapshots) and/or identities (to read encrypted ones), or remove it",
            ));
        }
        Ok(config)
    }

    fn log(&self, l: &RawLog) -> Result<LogConfig, ConfigError> {
        let format = self.one_of("log.format", &l.format, LOG_FORMATS)?;
        tracing_subscriber::EnvFilter::try_new(l.level.trim())
            .map_err(|e| self.err("log.level", format!("invalid level {:?} ({e})", l.level)))?;
        Ok(LogConfig {
            format,
            level: l.level.trim().to_string(),
        })
    }
}

/// An `[owner]` section validated, for the sidecar and for the operator's controllers; `err`
/// makes the error for a dotted key (`owner.name`), naming where its value came from.
pub(crate) fn owner_config(
    o: &RawOwner,
    err: &dyn Fn(&str, String) -> ConfigError,
) -> Result<OwnerConfig, ConfigError> {
    if o.name.trim().is_empty() {
        return Err(err(
            "owner.name",
            "required value missing: the owner DNS record's name".into(),
        ));
    }
    if o.id.trim().is_empty() {
        return Err(err(
            "owner.id",
            "required value missing: this seed's owner ID".into(),
        ));
    }
    let nameservers = o
        .nameservers
        .iter()
        .map(|ns| {
            parse_nameserver(ns).ok_or_else(|| {
                err(
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
            err(
                "owner.failure_threshold",
                "must be between 1 and 4294967295".into(),
            )
        })?;
    let duration = |key: &str, text: &str| parse_duration(text).map_err(|m| err(key, m));
    let positive = |key: &str, text: &str| {
        let d = duration(key, text)?;
        if d.is_zero() {
            return Err(err(key, "must be greater than zero".into()));
        }
        Ok(d)
    };
    Ok(OwnerConfig {
        name: o.name.trim().to_string(),
        id: o.id.clone(),
        interval: positive("owner.interval", &o.interval)?,
        timeout: positive("owner.timeout", &o.timeout)?,
        nameservers,
        failure_threshold,
        ttl_cap: duration("owner.ttl_cap", &o.ttl_cap)?,
        takeover_after: positive("owner.takeover_after", &o.takeover_after)?,
    })
}

/// An SSE-C key file's contents as the base64 S3 wants: the 32 raw bytes of the key (as
/// etcd-backup-restore's Secret holds it) or their base64 (44 characters, surrounding
/// whitespace ignored).
fn customer_key_base64(bytes: &[u8]) -> Result<String, String> {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    // A raw key written with a line break after it is still the raw key.
    let raw = bytes.strip_suffix(b"\n").unwrap_or(bytes);
    let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
    if bytes.len() == 32 || raw.len() == 32 {
        return Ok(b64.encode(if bytes.len() == 32 { bytes } else { raw }));
    }
    let text = std::str::from_utf8(bytes)
        .map(str::trim)
        .map_err(|_| "holds neither a 32-byte key nor its base64".to_string())?;
    match b64.decode(text) {
        Ok(key) if key.len() == 32 => Ok(b64.encode(key)),
        Ok(key) => Err(format!(
            "the key is {} bytes; SSE-C takes a 256-bit (32-byte) key",
            key.len()
        )),
        Err(_) => Err("holds neither a 32-byte key nor its base64".to_string()),
    }
}

/// A key's value trimmed, `None` when missing or blank.
fn given(value: &Option<String>) -> Option<String> {
    value
        .as_deref()
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(str::to_string)
}
