//! `etcd-warden-operator kube`'s configuration: embedded defaults → `--config` TOML file →
//! `ETCD_WARDEN_OPERATOR_*` environment → flags, layered by the sidecar's machinery
//! ([`crate::config::Layered`]), so unknown keys are refused and every error names the key and
//! where its value came from. Every key is at the top level; `ETCD_WARDEN_OPERATOR_<KEY>` sets
//! `<key>` and `--<key with dashes>` overrides both. `config.operator.example.toml` documents
//! every key.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

use super::controller::Settings;
use super::lease::LeaseTiming;
use super::machines::KubeMachinesConfig;
use super::quorum_guard::QuorumGuard;
use crate::config::{ConfigError, Layered, Layout, Sources, TlsFiles, lenient, parse_duration};
use crate::operator::control_plane_set::controller::replacement_for;
use crate::operator::control_plane_set::plan::Strategy;
use crate::operator::quorum::execute::Timing;
use crate::operator::quorum::plan::Spec;
use crate::owner::guard::GuardSettings;
use crate::owner::resolve::ResolveError;

/// The defaults: the first layer.
pub const DEFAULTS: &str = r#"
namespace = "openshift-etcd"
machine_namespace = "openshift-machine-api"
machine_selector = "machine.openshift.io/cluster-api-machine-role=master"
voters = 3
peer_scheme = "https"
peer_port = 2380
lease = "etcd-warden-operator"
guard_pdb = "etcd-guard-pdb"
guard_selector = "app=guard"
resync = "5s"
listen = "0.0.0.0:8080"
"#;

/// Prefix of the variables that set a key.
pub const ENV_PREFIX: &str = "ETCD_WARDEN_OPERATOR_";

/// The variable naming the file.
pub const ENV_CONFIG: &str = "ETCD_WARDEN_OPERATOR_CONFIG";

/// The operator's layout: flat keys under [`ENV_PREFIX`].
pub const LAYOUT: Layout = Layout {
    defaults: DEFAULTS,
    env_prefix: ENV_PREFIX,
    // `_API` is where the client subcommands find `local`'s HTTP API, not a key of `kube`.
    env_not_keys: &[ENV_CONFIG, "ETCD_WARDEN_OPERATOR_API"],
    // `ETCD_WARDEN_OPERATOR_OWNER_NAME` sets `owner.name`; every other key is top-level.
    sections: &["owner"],
    top_level: true,
};

/// The merged layers before validation.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKubeConfig {
    /// kubeconfig file; none: `$KUBECONFIG`, `~/.kube/config`, then in-cluster.
    pub kubeconfig: Option<String>,
    /// The operator's namespace.
    pub namespace: String,
    /// The Machines' namespace.
    pub machine_namespace: String,
    /// Label selector of the control-plane Machines.
    pub machine_selector: String,
    /// Desired voters.
    #[serde(deserialize_with = "lenient::unsigned")]
    pub voters: u64,
    /// etcd client URLs.
    #[serde(default, deserialize_with = "lenient::list")]
    pub etcd_endpoints: Vec<String>,
    /// CA of etcd's server certificates.
    pub etcd_ca_file: Option<String>,
    /// Client certificate.
    pub etcd_cert_file: Option<String>,
    /// Its key.
    pub etcd_key_file: Option<String>,
    /// Scheme of peer URLs.
    pub peer_scheme: String,
    /// Peer port.
    #[serde(deserialize_with = "lenient::unsigned")]
    pub peer_port: u64,
    /// Identity in the Lease.
    pub identity: Option<String>,
    /// The Lease's name.
    pub lease: String,
    /// The quorum-guard PDB's name.
    pub guard_pdb: String,
    /// The guard pods' labels, `k=v[,k=v]`.
    pub guard_selector: String,
    /// Resync period.
    pub resync: String,
    /// Address of `/healthz`, `/readyz` and `/metrics`.
    pub listen: String,
    /// The owner record (seed 001's controller watchdog), as the sidecar's `[owner]`.
    pub owner: Option<crate::config::RawOwner>,
    /// The ControlPlaneSet's strategy the quorum operator orders its changes for.
    pub set_strategy: Option<String>,
}

/// `kube`'s validated configuration.
#[derive(Debug, Clone)]
pub struct KubeConfig {
    /// kubeconfig file, when given.
    pub kubeconfig: Option<PathBuf>,
    /// Where health and metrics are served.
    pub listen: SocketAddr,
    /// The controller's settings.
    pub settings: Settings,
}

impl KubeConfig {
    /// Loads every layer and validates the result. `host_name` is the identity's last resort.
    pub fn load(
        sources: &Sources<'_>,
        host_name: Option<String>,
    ) -> Result<KubeConfig, ConfigError> {
        let layered = Layered::load(&LAYOUT, sources)?;
        let raw: RawKubeConfig = layered.deserialize()?;
        let pod_name = sources
            .env
            .vars()
            .into_iter()
            .find(|(k, _)| k == "POD_NAME")
            .map(|(_, v)| v);
        validate(&raw, &layered, pod_name.or(host_name))
    }
}

fn non_empty(l: &Layered, key: &str, v: &str) -> Result<String, ConfigError> {
    let v = v.trim();
    if v.is_empty() {
        return Err(l.err(key, "is empty"));
    }
    Ok(v.to_owned())
}

fn file(l: &Layered, key: &str, v: &Option<String>) -> Result<Option<PathBuf>, ConfigError> {
    let Some(v) = v else { return Ok(None) };
    let p = PathBuf::from(non_empty(l, key, v)?);
    if !p.is_file() {
        return Err(l.err(
            key,
            format!(
                "file {} does not exist or is not a regular file",
                p.display()
            ),
        ));
    }
    Ok(Some(p))
}

fn validate(
    raw: &RawKubeConfig,
    l: &Layered,
    identity_fallback: Option<String>,
) -> Result<KubeConfig, ConfigError> {
    let voters = usize::try_from(raw.voters).unwrap_or(usize::MAX);
    let spec = Spec::new(voters).map_err(|e| l.err("voters", e.to_string()))?;
    if raw.etcd_endpoints.is_empty() {
        return Err(l.err("etcd_endpoints", "required: at least one etcd client URL"));
    }
    for (i, ep) in raw.etcd_endpoints.iter().enumerate() {
        if !(ep.starts_with("http://") || ep.starts_with("https://")) {
            return Err(l.err(
                &format!("etcd_endpoints[{i}]"),
                format!("{ep:?} is not an http:// or https:// URL"),
            ));
        }
    }
    let ca = file(l, "etcd_ca_file", &raw.etcd_ca_file)?;
    let cert = file(l, "etcd_cert_file", &raw.etcd_cert_file)?;
    let key = file(l, "etcd_key_file", &raw.etcd_key_file)?;
    match (&cert, &key) {
        (Some(_), None) => return Err(l.err("etcd_key_file", "required with etcd_cert_file")),
        (None, Some(_)) => return Err(l.err("etcd_cert_file", "required with etcd_key_file")),
        _ => {}
    }
    let peer_scheme = match raw.peer_scheme.trim() {
        s @ ("http" | "https") => s.to_owned(),
        other => {
            return Err(l.err("peer_scheme", format!("{other:?}: one of http, https")));
        }
    };
    let peer_port = u16::try_from(raw.peer_port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| {
            l.err(
                "peer_port",
                format!("{} is not a port (1-65535)", raw.peer_port),
            )
        })?;
    let mut pod_labels = BTreeMap::new();
    for kv in raw
        .guard_selector
        .split(',')
        .filter(|s| !s.trim().is_empty())
    {
        let (k, v) = kv
            .split_once('=')
            .filter(|(k, _)| !k.trim().is_empty())
            .ok_or_else(|| l.err("guard_selector", format!("{kv:?} is not k=v")))?;
        pod_labels.insert(k.trim().to_owned(), v.trim().to_owned());
    }
    if pod_labels.is_empty() {
        return Err(l.err("guard_selector", "needs at least one k=v"));
    }
    let resync = parse_duration(&raw.resync).map_err(|m| l.err("resync", m))?;
    if resync.is_zero() {
        return Err(l.err("resync", "must be greater than zero"));
    }
    let listen: SocketAddr = raw.listen.trim().parse().map_err(|_| {
        l.err(
            "listen",
            format!("{:?} is not an address such as 0.0.0.0:8080", raw.listen),
        )
    })?;
    let identity = match &raw.identity {
        Some(i) => non_empty(l, "identity", i)?,
        None => identity_fallback
            .filter(|h| !h.trim().is_empty())
            .ok_or_else(|| l.err("identity", "none given, no $POD_NAME and no host name"))?,
    };
    let namespace = non_empty(l, "namespace", &raw.namespace)?;
    let kubeconfig = match &raw.kubeconfig {
        Some(k) => Some(PathBuf::from(non_empty(l, "kubeconfig", k)?)),
        None => None,
    };
    let owner = match &raw.owner {
        None => None,
        Some(o) => {
            let config = crate::config::owner_config(o, &|key, message| l.err(key, message))?;
            let guard = GuardSettings::new(&config).map_err(|e| {
                // An unreadable resolv.conf only matters when no nameservers are given.
                let key = match e {
                    ResolveError::InvalidName { .. } => "owner.name",
                    _ => "owner.nameservers",
                };
                l.err(key, e.to_string())
            })?;
            Some(guard)
        }
    };
    let mut spec = spec;
    if let Some(text) = &raw.set_strategy {
        let strategy = match text
            .trim()
            .to_ascii_lowercase()
            .replace(['-', '_'], "")
            .as_str()
        {
            "rollingupdate" => Strategy::RollingUpdate,
            "recreate" => Strategy::Recreate,
            "ondelete" => Strategy::OnDelete,
            _ => {
                return Err(l.err(
                    "set_strategy",
                    format!("{text:?}: one of RollingUpdate, Recreate, OnDelete"),
                ));
            }
        };
        spec.replacement = replacement_for(strategy);
    }
    let settings = Settings {
        owner,
        spec,
        machines: KubeMachinesConfig {
            namespace: non_empty(l, "machine_namespace", &raw.machine_namespace)?,
            selector: non_empty(l, "machine_selector", &raw.machine_selector)?,
            peer_scheme,
            peer_port,
            ..KubeMachinesConfig::default()
        },
        etcd_endpoints: raw.etcd_endpoints.clone(),
        etcd_tls: (ca.is_some() || cert.is_some()).then_some(TlsFiles {
            ca_file: ca,
            cert_file: cert,
            key_file: key,
        }),
        guard: QuorumGuard {
            name: non_empty(l, "guard_pdb", &raw.guard_pdb)?,
            namespace: namespace.clone(),
            pod_labels,
        },
        namespace,
        lease_name: non_empty(l, "lease", &raw.lease)?,
        identity,
        lease: LeaseTiming::default(),
        timing: Timing {
            interval: resync,
            ..Timing::default()
        },
    };
    Ok(KubeConfig {
        kubeconfig,
        listen,
        settings,
    })
}
