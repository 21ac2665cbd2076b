//! Kubernetes RBAC, evaluated the way the API server's authorizer does, over the requests the
//! API-server double logged: each request becomes (verb, API group, resource[/subresource],
//! namespace, name) as the server's request-info does (GET of a name is `get`, of a collection
//! `list`, or `watch` with `watch=true`; POST `create`, PUT `update`, PATCH `patch`, DELETE
//! `delete`; a list or watch whose `fieldSelector` is `metadata.name=X` is named X), and is
//! allowed when a Role bound to the service account in that namespace (or a ClusterRole bound
//! cluster-wide) has a rule matching it.
//!
//! What it does not model: aggregated ClusterRoles, `nonResourceURLs`, impersonation, and
//! `resourceNames` on `create` (upstream never matches them: the name is not known yet).
#![allow(dead_code)]

use std::path::Path;

use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use serde::Deserialize;

/// One request as the authorizer sees it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Attributes {
    pub verb: String,
    pub group: String,
    /// `machines` or `machines/status`.
    pub resource: String,
    pub namespace: String,
    pub name: String,
}

/// A logged request (`"PATCH /apis/g/v/namespaces/ns/r/name/status?x=y"`) as attributes; `None`
/// for non-resource paths.
pub fn attributes(request: &str) -> Option<Attributes> {
    let (method, target) = request.split_once(' ')?;
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, mut rest) = match *segs.first()? {
        "api" => ("", segs.get(2..)?),
        "apis" => (*segs.get(1)?, segs.get(3..)?),
        _ => return None,
    };
    let mut namespace = "";
    if rest.len() >= 3 && rest[0] == "namespaces" {
        namespace = rest[1];
        rest = &rest[2..];
    }
    let resource = match rest.get(2) {
        Some(sub) => format!("{}/{sub}", rest.first()?),
        None => (*rest.first()?).to_owned(),
    };
    let params: Vec<(String, String)> = url::form_urlencoded::parse(query.as_bytes())
        .into_owned()
        .collect();
    let param = |k: &str| params.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let mut name = rest.get(1).copied().unwrap_or_default().to_owned();
    let verb = match (method, name.is_empty()) {
        ("GET", false) => "get",
        ("GET", true) if param("watch") == Some("true") => "watch",
        ("GET", true) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "deletecollection",
        ("DELETE", false) => "delete",
        _ => return None,
    };
    if matches!(verb, "list" | "watch")
        && let Some(sel) = param("fieldSelector")
        && let Some(n) = sel.strip_prefix("metadata.name=")
        && !n.contains(',')
    {
        name = n.to_owned();
    }
    Some(Attributes {
        verb: verb.into(),
        group: group.into(),
        resource,
        namespace: namespace.into(),
        name,
    })
}

/// The Roles, ClusterRoles and their bindings of some manifests.
#[derive(Debug, Default)]
pub struct Policy {
    roles: Vec<Role>,
    cluster_roles: Vec<ClusterRole>,
    bindings: Vec<RoleBinding>,
    cluster_bindings: Vec<ClusterRoleBinding>,
}

impl Policy {
    /// Every RBAC object in the YAML files given; other kinds are skipped.
    pub fn load(files: &[&Path]) -> Policy {
        let mut p = Policy::default();
        for file in files {
            let text = std::fs::read_to_string(file)
                .unwrap_or_else(|e| panic!("read {}: {e}", file.display()));
            for doc in serde_yaml::Deserializer::from_str(&text) {
                let v = serde_json::Value::deserialize(doc).expect("YAML");
                fn parse<T: serde::de::DeserializeOwned>(file: &Path, v: serde_json::Value) -> T {
                    serde_json::from_value(v).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
                }
                match v["kind"].as_str() {
                    Some("Role") => p.roles.push(parse(file, v)),
                    Some("ClusterRole") => p.cluster_roles.push(parse(file, v)),
                    Some("RoleBinding") => p.bindings.push(parse(file, v)),
                    Some("ClusterRoleBinding") => p.cluster_bindings.push(parse(file, v)),
                    _ => {}
                }
            }
        }
        p
    }

    /// Whether the service account `namespace/name` may make the request.
    pub fn allows(&self, sa: (&str, &str), a: &Attributes) -> bool {
        let is_subject = |subjects: &Option<Vec<k8s_openapi::api::rbac::v1::Subject>>| {
            subjects.iter().flatten().any(|s| {
                s.kind == "ServiceAccount" && s.name == sa.1 && s.namespace.as_deref() == Some(sa.0)
            })
        };
        let cluster_rules = |role: &str| -> Vec<PolicyRule> {
            self.cluster_roles
                .iter()
                .filter(|r| r.metadata.name.as_deref() == Some(role))
                .flat_map(|r| r.rules.clone().unwrap_or_default())
                .collect()
        };
        let mut rules: Vec<PolicyRule> = Vec::new();
        for b in self
            .cluster_bindings
            .iter()
            .filter(|b| is_subject(&b.subjects))
        {
            rules.extend(cluster_rules(&b.role_ref.name));
        }
        if !a.namespace.is_empty() {
            for b in self.bindings.iter().filter(|b| {
                b.metadata.namespace.as_deref() == Some(&a.namespace) && is_subject(&b.subjects)
            }) {
                match b.role_ref.kind.as_str() {
                    "ClusterRole" => rules.extend(cluster_rules(&b.role_ref.name)),
                    _ => rules.extend(
                        self.roles
                            .iter()
                            .filter(|r| {
                                r.metadata.name.as_deref() == Some(&b.role_ref.name)
                                    && r.metadata.namespace.as_deref() == Some(&a.namespace)
                            })
                            .flat_map(|r| r.rules.clone().unwrap_or_default()),
                    ),
                }
            }
        }
        rules.iter().any(|r| matches(r, a))
    }

    /// The requests of `log` the service account may not make, each once.
    pub fn denied(&self, sa: (&str, &str), log: &[String]) -> Vec<Attributes> {
        let mut out: Vec<Attributes> = log
            .iter()
            .filter_map(|r| attributes(r))
            .filter(|a| !self.allows(sa, a))
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

fn matches(rule: &PolicyRule, a: &Attributes) -> bool {
    let any =
        |list: &Option<Vec<String>>, v: &str| list.iter().flatten().any(|x| x == "*" || x == v);
    let names = rule.resource_names.as_deref().unwrap_or_default();
    any(&Some(rule.verbs.clone()), &a.verb)
        && any(&rule.api_groups, &a.group)
        && any(&rule.resources, &a.resource)
        && (names.is_empty() || (a.verb != "create" && names.contains(&a.name)))
}

/// Who the operator's requests come from in the API-server double's log (see
/// `ApiServer::client_as`).
pub const OPERATOR: &str = "operator";

/// Every request the operator made to `server` (through `client_as(OPERATOR)`) is one
/// deploy/operator/rbac.yaml lets its service account make.
pub fn assert_operator_allowed(server: &super::apiserver::ApiServer) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/operator");
    let policy = Policy::load(&[&dir.join("rbac.yaml")]);
    let made = server.requests_of(OPERATOR);
    assert!(made.len() > 10, "the operator made {} requests", made.len());
    let denied = policy.denied(("openshift-etcd", "etcd-warden-operator"), &made);
    assert!(
        denied.is_empty(),
        "deploy/operator/rbac.yaml denies {denied:#?}"
    );
}
