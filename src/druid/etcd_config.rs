//! etcd's configuration as etcd-backup-restore serves it on `/config`, computed from the file druid
//! writes (`etcd.conf.yaml`: every member's advertise URLs as maps, the whole initial cluster)
//! for the member in this pod: its `name`, its own `initial-advertise-peer-urls` and
//! `advertise-client-urls` as comma-joined strings, `initial-cluster` trimmed to the cluster's
//! current members (and this one) when the cluster lists more than one, and
//! `initial-cluster-state`: `new` for one member, `existing` when the cluster has a learner (a
//! member being added), `new` otherwise or when the cluster cannot be asked (a first bootstrap,
//! where no etcd answers yet). That is etcd-backup-restore's rule at its `debd95bd` (the learner
//! check; the releases druid pins read the StatefulSet's replicas instead, which needs RBAC this
//! does not). Every other key passes through unchanged, sorted by name as
//! etcd-backup-restore writes them.
//!
//! Pure: the caller reads the file and asks the cluster for its members.

use serde_yaml::{Mapping, Value};

use crate::config::PeerTls;

/// What the file cannot give.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("etcd configuration: {0}")]
pub struct EtcdConfigError(pub String);

/// A member as the cluster lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub name: String,
    pub is_learner: bool,
}

/// This pod's member, from the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// `<member-name-prefix>-<pod>`, or the pod's name.
    pub name: String,
    /// Its peer URLs, comma-joined.
    pub peer_urls: String,
    /// Its client URLs, comma-joined.
    pub client_urls: String,
    /// `initial-cluster` as the file has it.
    pub initial_cluster: String,
    /// `initial-cluster-token` (etcd's default when absent).
    pub initial_cluster_token: String,
    /// `data-dir`, when the file names one.
    pub data_dir: Option<String>,
    /// `peer-transport-security`, when it names a certificate and its key.
    pub peer_tls: Option<PeerTls>,
}

fn parse(text: &str) -> Result<Mapping, EtcdConfigError> {
    match serde_yaml::from_str::<Value>(text) {
        Ok(Value::Mapping(m)) => Ok(m),
        Ok(_) => Err(EtcdConfigError("the file is not a YAML mapping".into())),
        Err(e) => Err(EtcdConfigError(format!("not YAML: {e}"))),
    }
}

fn text(m: &Mapping, key: &str) -> Option<String> {
    match m.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// This member's URLs in the map under `key`, checked to be URLs.
fn own_urls(m: &Mapping, key: &str, name: &str) -> Result<String, EtcdConfigError> {
    let urls = m
        .get(key)
        .and_then(Value::as_mapping)
        .and_then(|map| map.get(name))
        .ok_or_else(|| EtcdConfigError(format!("{key} has no entry for this member {name:?}")))?;
    let list: Vec<String> = match urls {
        Value::Sequence(items) => items
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                EtcdConfigError(format!("{key}.{name} holds a value that is not a URL"))
            })?,
        Value::String(s) => s.split(',').map(str::trim).map(str::to_string).collect(),
        _ => {
            return Err(EtcdConfigError(format!(
                "{key}.{name} is not a list of URLs"
            )));
        }
    };
    if list.is_empty() {
        return Err(EtcdConfigError(format!("{key}.{name} is empty")));
    }
    for u in &list {
        url::Url::parse(u).map_err(|e| EtcdConfigError(format!("{key}.{name}: {u:?}: {e}")))?;
    }
    Ok(list.join(","))
}

/// This pod's member, as the file describes it.
pub fn member(text: &str, pod_name: &str) -> Result<Member, EtcdConfigError> {
    let m = parse(text)?;
    member_of(&m, pod_name)
}

fn member_of(m: &Mapping, pod_name: &str) -> Result<Member, EtcdConfigError> {
    let name = match text(m, "member-name-prefix").filter(|p| !p.is_empty()) {
        Some(prefix) => format!("{prefix}-{pod_name}"),
        None => pod_name.to_string(),
    };
    Ok(Member {
        peer_urls: own_urls(m, "initial-advertise-peer-urls", &name)?,
        client_urls: own_urls(m, "advertise-client-urls", &name)?,
        initial_cluster: text(m, "initial-cluster").unwrap_or_default(),
        initial_cluster_token: text(m, "initial-cluster-token")
            .unwrap_or_else(|| "etcd-cluster".into()),
        data_dir: text(m, "data-dir"),
        peer_tls: peer_tls(m),
        name,
    })
}

/// `peer-transport-security`'s `cert-file`, `key-file`, `trusted-ca-file` and
/// `client-cert-auth`, as etcd reads them; `None` without a certificate and its key (`auto-tls`
/// makes one that no other member trusts).
fn peer_tls(m: &Mapping) -> Option<PeerTls> {
    let section = m.get("peer-transport-security")?.as_mapping()?;
    let file = |key: &str| text(section, key).filter(|f| !f.trim().is_empty());
    Some(PeerTls {
        cert_file: file("cert-file")?.into(),
        key_file: file("key-file")?.into(),
        ca_file: file("trusted-ca-file").map(Into::into),
        client_cert_auth: section
            .get("client-cert-auth")
            .and_then(Value::as_bool)
            .unwrap_or(false),
    })
}

/// The names in an `initial-cluster` value, in order, each once.
fn names(initial_cluster: &str) -> Result<Vec<String>, EtcdConfigError> {
    let mut out: Vec<String> = Vec::new();
    for entry in initial_cluster.split(',').filter(|e| !e.trim().is_empty()) {
        let (name, _) = entry.split_once('=').ok_or_else(|| {
            EtcdConfigError(format!(
                "initial-cluster entry {entry:?} is not name=peerURL"
            ))
        })?;
        let name = name.trim().to_string();
        if !out.contains(&name) {
            out.push(name);
        }
    }
    Ok(out)
}

/// `initial-cluster` trimmed to the listed members and `me`, when the cluster lists several.
pub fn initial_cluster(file: &str, me: &str, listed: Option<&[Listed]>) -> String {
    let Some(listed) = listed.filter(|l| l.len() > 1) else {
        return file.to_string();
    };
    file.split(',')
        .filter(|e| !e.trim().is_empty())
        .filter(|e| {
            let name = e.split_once('=').map_or(*e, |(n, _)| n).trim();
            name == me || listed.iter().any(|l| l.name == name)
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// `new` or `existing`, as above.
pub fn cluster_state(
    initial_cluster: &str,
    listed: Option<&[Listed]>,
) -> Result<&'static str, EtcdConfigError> {
    if names(initial_cluster)?.len() <= 1 {
        return Ok("new");
    }
    Ok(match listed {
        Some(l) if l.iter().any(|m| m.is_learner) => "existing",
        _ => "new",
    })
}

/// The configuration `/config` serves: the file with this member's values. `listed` is the
/// cluster's member list, `None` when no member answered.
pub fn render(
    text: &str,
    pod_name: &str,
    listed: Option<&[Listed]>,
) -> Result<String, EtcdConfigError> {
    let m = parse(text)?;
    let me = member_of(&m, pod_name)?;
    let cluster = initial_cluster(&me.initial_cluster, &me.name, listed);
    let state = cluster_state(&cluster, listed)?;
    let mut out: Vec<(String, Value)> = m
        .into_iter()
        .filter_map(|(k, v)| Some((k.as_str()?.to_string(), v)))
        .collect();
    let mut set = |key: &str, value: String| match out.iter_mut().find(|(k, _)| k == key) {
        Some(entry) => entry.1 = Value::String(value),
        None => out.push((key.to_string(), Value::String(value))),
    };
    set("name", me.name.clone());
    set("initial-advertise-peer-urls", me.peer_urls.clone());
    set("advertise-client-urls", me.client_urls.clone());
    set("initial-cluster", cluster);
    set("initial-cluster-state", state.to_string());
    out.sort_by(|a, b| a.0.cmp(&b.0));
    let mapping: Mapping = out
        .into_iter()
        .map(|(k, v)| (Value::String(k), v))
        .collect();
    serde_yaml::to_string(&Value::Mapping(mapping))
        .map_err(|e| EtcdConfigError(format!("cannot write YAML: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What druid's `etcdconfig.go` writes for a three-member Etcd `etcd-main` in `shoot` with
    /// peer TLS and a member-name prefix.
    const DRUID: &str = "\
name: etcd-config
data-dir: /var/etcd/data/new.etcd
metrics: extensive
snapshot-count: 10000
enable-grpc-gateway: false
quota-backend-bytes: 8589934592
initial-cluster-token: etcd-cluster
initial-cluster-state: new
initial-cluster: m-etcd-main-0=https://etcd-main-0.etcd-main-peer.shoot.svc:2380,m-etcd-main-1=https://etcd-main-1.etcd-main-peer.shoot.svc:2380,m-etcd-main-2=https://etcd-main-2.etcd-main-peer.shoot.svc:2380
auto-compaction-mode: periodic
auto-compaction-retention: 30m
listen-peer-urls: https://0.0.0.0:2380
listen-client-urls: https://0.0.0.0:2379
initial-advertise-peer-urls:
  m-etcd-main-0:
  - https://etcd-main-0.etcd-main-peer.shoot.svc:2380
  m-etcd-main-1:
  - https://etcd-main-1.etcd-main-peer.shoot.svc:2380
  m-etcd-main-2:
  - https://etcd-main-2.etcd-main-peer.shoot.svc:2380
advertise-client-urls:
  m-etcd-main-0:
  - https://etcd-main-0.etcd-main-peer.shoot.svc:2379
  m-etcd-main-1:
  - https://etcd-main-1.etcd-main-peer.shoot.svc:2379
  - https://etcd-main-1.example:2379
  m-etcd-main-2:
  - https://etcd-main-2.etcd-main-peer.shoot.svc:2379
client-transport-security:
  cert-file: /var/etcd/ssl/server/tls.crt
  key-file: /var/etcd/ssl/server/tls.key
  client-cert-auth: true
  trusted-ca-file: /var/etcd/ssl/ca/ca.crt
  auto-tls: false
peer-transport-security:
  cert-file: /var/etcd/ssl/peer/server/tls.crt
  key-file: /var/etcd/ssl/peer/server/tls.key
  client-cert-auth: true
  trusted-ca-file: /var/etcd/ssl/peer/ca/ca.crt
  auto-tls: false
member-name-prefix: m
next-cluster-version-compatible: true
";

    fn listed(names: &[(&str, bool)]) -> Vec<Listed> {
        names
            .iter()
            .map(|(n, l)| Listed {
                name: n.to_string(),
                is_learner: *l,
            })
            .collect()
    }

    fn rendered(pod: &str, list: Option<&[Listed]>) -> Mapping {
        let text = render(DRUID, pod, list).unwrap();
        serde_yaml::from_str(&text).unwrap()
    }

    fn get<'a>(m: &'a Mapping, key: &str) -> &'a str {
        m.get(key)
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("{key}"))
    }

    #[test]
    fn the_members_own_values_replace_the_maps_and_everything_else_passes() {
        let m = rendered("etcd-main-1", None);
        assert_eq!(get(&m, "name"), "m-etcd-main-1");
        assert_eq!(
            get(&m, "initial-advertise-peer-urls"),
            "https://etcd-main-1.etcd-main-peer.shoot.svc:2380"
        );
        assert_eq!(
            get(&m, "advertise-client-urls"),
            "https://etcd-main-1.etcd-main-peer.shoot.svc:2379,https://etcd-main-1.example:2379"
        );
        // No cluster to ask: the whole initial cluster, a new one.
        assert_eq!(get(&m, "initial-cluster").split(',').count(), 3);
        assert_eq!(get(&m, "initial-cluster-state"), "new");
        assert_eq!(
            m.get("quota-backend-bytes").and_then(Value::as_u64),
            Some(8_589_934_592)
        );
        assert_eq!(
            m.get("client-transport-security")
                .and_then(|v| v.get("client-cert-auth"))
                .and_then(Value::as_bool),
            Some(true)
        );
        let keys: Vec<&str> = m.keys().filter_map(Value::as_str).collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(
            keys, sorted,
            "keys sorted as etcd-backup-restore writes them"
        );
    }

    #[test]
    fn the_cluster_decides_initial_cluster_and_its_state() {
        // A restart: all three listed, no learner.
        let all = listed(&[
            ("m-etcd-main-0", false),
            ("m-etcd-main-1", false),
            ("m-etcd-main-2", false),
        ]);
        let m = rendered("etcd-main-1", Some(&all));
        assert_eq!(get(&m, "initial-cluster-state"), "new");
        assert_eq!(get(&m, "initial-cluster").split(',').count(), 3);
        // A scale-up from two: this member added as a learner; the third not yet a member.
        let two = listed(&[("m-etcd-main-0", false), ("m-etcd-main-1", true)]);
        let m = rendered("etcd-main-1", Some(&two));
        assert_eq!(get(&m, "initial-cluster-state"), "existing");
        assert_eq!(
            get(&m, "initial-cluster"),
            "m-etcd-main-0=https://etcd-main-0.etcd-main-peer.shoot.svc:2380,\
             m-etcd-main-1=https://etcd-main-1.etcd-main-peer.shoot.svc:2380"
        );
        // One listed member is not a cluster to trim to.
        let one = listed(&[("m-etcd-main-0", false)]);
        let m = rendered("etcd-main-1", Some(&one));
        assert_eq!(get(&m, "initial-cluster").split(',').count(), 3);
    }

    #[test]
    fn the_peer_certificate_is_read_from_peer_transport_security() {
        let me = member(DRUID, "etcd-main-0").unwrap();
        assert_eq!(
            me.peer_tls,
            Some(PeerTls {
                cert_file: "/var/etcd/ssl/peer/server/tls.crt".into(),
                key_file: "/var/etcd/ssl/peer/server/tls.key".into(),
                ca_file: Some("/var/etcd/ssl/peer/ca/ca.crt".into()),
                client_cert_auth: true,
            })
        );
        // auto-tls alone, or no section: no certificate to start a member with.
        let auto = "initial-advertise-peer-urls:\n  p: [https://p:2380]\n\
                    advertise-client-urls:\n  p: [https://p:2379]\n\
                    peer-transport-security:\n  auto-tls: true\n";
        assert_eq!(member(auto, "p").unwrap().peer_tls, None);
        let none = auto.replace("peer-transport-security:\n  auto-tls: true\n", "");
        assert_eq!(member(&none, "p").unwrap().peer_tls, None);
    }

    #[test]
    fn a_single_member_is_always_new() {
        let single = "name: x\ninitial-cluster: etcd-0=http://etcd-0:2380\n\
                      initial-advertise-peer-urls:\n  etcd-0: [http://etcd-0:2380]\n\
                      advertise-client-urls:\n  etcd-0: [http://etcd-0:2379]\n";
        let text = render(single, "etcd-0", Some(&listed(&[("etcd-0", true)]))).unwrap();
        assert!(text.contains("initial-cluster-state: new"), "{text}");
        let me = member(single, "etcd-0").unwrap();
        assert_eq!(me.initial_cluster_token, "etcd-cluster");
        assert_eq!(me.data_dir, None);
    }

    #[test]
    fn what_the_file_cannot_give_is_named() {
        let e = render(DRUID, "etcd-main-9", None).unwrap_err();
        assert!(e.0.contains("m-etcd-main-9"), "{e}");
        let no_list = DRUID.replace(
            "  m-etcd-main-1:\n  - https://etcd-main-1.etcd-main-peer.shoot.svc:2380\n",
            "  m-etcd-main-1: []\n",
        );
        let e = render(&no_list, "etcd-main-1", None).unwrap_err();
        assert!(
            e.0.contains("initial-advertise-peer-urls.m-etcd-main-1 is empty"),
            "{e}"
        );
        let bad = DRUID.replace("https://etcd-main-1.example:2379", "not a url");
        let e = render(&bad, "etcd-main-1", None).unwrap_err();
        assert!(e.0.contains("not a url"), "{e}");
        assert!(render("- a\n- b\n", "p", None).is_err());
    }
}
