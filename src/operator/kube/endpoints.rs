//! The `etcd-endpoints` ConfigMap (seed 002): built from etcd's member list, not from nodes.
//!
//! One key per member — voters, learners, and members added but not started yet (etcd lists
//! them with a peer URL and no name) — the key its member ID in hex as etcdctl prints it, the
//! value the IP of its peer URL. A removed member's key goes with it: [`merge_patch`] sets it
//! to `null`, since a merge patch otherwise keeps keys it does not name.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ::kube::api::Api;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::{Map, Value};

use crate::operator::quorum::plan::MemberState;

/// The ConfigMap's name, as its consumers know it.
pub const NAME: &str = "etcd-endpoints";

/// A member whose peer URL names no IP.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("member {id:x}: peer URL {url:?} names no IP address")]
pub struct EndpointsError {
    /// The member.
    pub id: u64,
    /// Its first peer URL (empty when it has none).
    pub url: String,
}

/// The IP of a peer URL (`https://10.0.0.1:2380`, `https://[fd00::1]:2380`), without brackets.
fn peer_ip(url: &str) -> Option<IpAddr> {
    let parsed = url::Url::parse(url).ok()?;
    match parsed.host()? {
        url::Host::Ipv4(ip) => Some(IpAddr::V4(ip)),
        url::Host::Ipv6(ip) => Some(IpAddr::V6(ip)),
        url::Host::Domain(_) => None,
    }
}

/// The ConfigMap's data: hex member ID → IP, for every member in the list. Refuses a member
/// whose peer URL names no IP rather than leave it out: consumers build etcd's initial cluster
/// from this map, and a missing member is worse than a map not updated.
pub fn data(members: &[MemberState]) -> Result<BTreeMap<String, String>, EndpointsError> {
    members
        .iter()
        .map(|m| {
            let url = m.peer_urls.first().cloned().unwrap_or_default();
            let ip = peer_ip(&url).ok_or(EndpointsError { id: m.id, url })?;
            Ok((format!("{:x}", m.id), ip.to_string()))
        })
        .collect()
}

/// The whole ConfigMap for `data` in `namespace`.
pub fn config_map(namespace: &str, data: BTreeMap<String, String>) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(NAME.into()),
            namespace: Some(namespace.into()),
            ..ObjectMeta::default()
        },
        data: Some(data),
        ..ConfigMap::default()
    }
}

/// The JSON merge patch that turns `current` data into `desired` (removed keys set to `null`),
/// carrying `resource_version` so a concurrent writer makes it fail with 409; `None` when
/// nothing differs.
pub fn merge_patch(
    current: &BTreeMap<String, String>,
    desired: &BTreeMap<String, String>,
    resource_version: &str,
) -> Option<Value> {
    if current == desired {
        return None;
    }
    let mut changes = Map::new();
    for k in current.keys().filter(|k| !desired.contains_key(*k)) {
        changes.insert(k.clone(), Value::Null);
    }
    for (k, v) in desired.iter().filter(|(k, v)| current.get(*k) != Some(*v)) {
        changes.insert(k.clone(), Value::String(v.clone()));
    }
    Some(serde_json::json!({
        "metadata": {"resourceVersion": resource_version},
        "data": changes,
    }))
}

/// Errors of [`sync`].
#[derive(Debug, thiserror::Error)]
pub enum SyncEndpointsError {
    /// The desired content could not be computed.
    #[error(transparent)]
    Data(#[from] EndpointsError),
    /// Writing it failed.
    #[error(transparent)]
    Write(#[from] super::sync::SyncError),
}

impl SyncEndpointsError {
    /// Whether trying again later may succeed without anyone changing anything.
    pub fn is_transient(&self) -> bool {
        match self {
            SyncEndpointsError::Data(_) => false,
            SyncEndpointsError::Write(e) => e.is_transient(),
        }
    }
}

/// Makes the ConfigMap in `api`'s namespace list exactly `members`; returns whether it wrote.
pub async fn sync(
    api: &Api<ConfigMap>,
    namespace: &str,
    members: &[MemberState],
) -> Result<bool, SyncEndpointsError> {
    let want = data(members)?;
    Ok(super::sync::upsert(
        api,
        NAME,
        || config_map(namespace, want.clone()),
        |cm| {
            let rv = cm.metadata.resource_version.clone().unwrap_or_default();
            merge_patch(&cm.data.clone().unwrap_or_default(), &want, &rv)
        },
    )
    .await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: u64, name: &str, url: &str, learner: bool) -> MemberState {
        MemberState {
            id,
            name: name.into(),
            peer_urls: vec![url.into()],
            is_learner: learner,
            healthy: !name.is_empty(),
            applied_index: 0,
        }
    }

    #[test]
    fn one_key_per_member_voters_learners_and_unstarted() {
        let members = [
            member(0x13c8677970c567e2, "a", "https://10.0.185.161:2380", false),
            member(0x85d0b011227abdc2, "b", "https://10.0.185.212:2380", false),
            member(0x867988777c0cacfc, "c", "https://10.0.199.235:2380", true),
            // Added, not started: no name yet.
            member(0x2a, "", "https://[fd00::7]:2380", true),
        ];
        let d = data(&members).unwrap();
        let want: BTreeMap<String, String> = [
            ("13c8677970c567e2", "10.0.185.161"),
            ("85d0b011227abdc2", "10.0.185.212"),
            ("867988777c0cacfc", "10.0.199.235"),
            ("2a", "fd00::7"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(d, want);
        let cm = config_map("openshift-etcd", d.clone());
        assert_eq!(cm.metadata.name.as_deref(), Some("etcd-endpoints"));
        assert_eq!(cm.data, Some(d));
    }

    #[test]
    fn a_member_without_an_ip_is_refused() {
        let e = data(&[member(1, "a", "https://etcd-0.example:2380", false)]).unwrap_err();
        assert_eq!(e.id, 1);
        let mut m = member(2, "", "", true);
        m.peer_urls.clear();
        assert!(data(&[m]).is_err());
    }

    #[test]
    fn the_patch_removes_a_removed_members_key_and_is_none_when_equal() {
        let cur: BTreeMap<String, String> = [("1", "10.0.0.1"), ("2", "10.0.0.2")]
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        let want: BTreeMap<String, String> = [("2", "10.0.0.2"), ("3", "10.0.0.3")]
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        let p = merge_patch(&cur, &want, "42").unwrap();
        assert_eq!(
            p,
            serde_json::json!({
                "metadata": {"resourceVersion": "42"},
                "data": {"1": null, "3": "10.0.0.3"},
            })
        );
        assert_eq!(merge_patch(&want, &want, "42"), None);
    }
}
