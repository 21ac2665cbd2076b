//! The Kubernetes manifests under deploy/: every file parses into its k8s-openapi type (no field
//! the type does not know), every kustomization refers to files that exist, and the invariants
//! the sidecar depends on hold: a shared PID namespace, etcd's readiness probe on the sidecar's
//! `/healthz` port, the sidecar's config mounted where its args say and accepted by the real
//! `etcd-warden config` and by its subcommand (`serve` beyond loopback needs the bearer token),
//! credential files on Secret mounts, no capability beyond what the kill needs, the copy Job
//! waiting for the final snapshot. Mutated manifests show the checks bite.
//! Also: the Containerfile builds what Cargo.toml names and carries etcd's version, and every
//! metric the alert rules in docs/operations.md, the `PrometheusRule` and the Grafana dashboard
//! in deploy/monitoring use is exported (by the sidecar, or by both etcd 3.4 and 3.5, scraped
//! from real members); the `PrometheusRule` holds exactly the documented rules.
//! deploy/operator: its CRDs are exactly what `etcd-warden-operator crdgen` prints; the
//! Deployment runs two replicas (Lease identity from the pod name) on different nodes with its
//! own service account, non-root and without capabilities, its mounted `operator.toml` accepted
//! by the real loader, the etcd certificates on the Secret's mount and the probes on `listen`;
//! its RBAC is namespaced, wildcard-free, Secret-free and bound only to that account (which
//! verbs the operator really needs is checked against its requests in tests/operator_kube.rs).
//! deploy/kubeadm: a DaemonSet on the control-plane nodes, on the host network, reaching its own
//! node's member over loopback with kubeadm's etcd CA and `healthcheck-client` certificate mounted
//! read-only file by file, no `[owner]`, no shared PID namespace, and the drill on the same store.

use crate::support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use etcd_warden::config::{Config, Purpose, Sources};
use etcd_warden::operator::control_plane_set::resource::ControlPlaneSet;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use k8s_openapi::api::batch::v1::{CronJob, Job};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::core::v1::{ConfigMap, Container, PodSpec, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::Deserialize;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Values the kubelet would give the downward-API variables the manifests use.
const POD_NAME: &str = "etcd-main-0";
const POD_NAMESPACE: &str = "shoot--test";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// Every YAML file under `dir`, recursively, sorted.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            out.extend(yaml_files(&path));
        } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// The documents of a (multi-document) YAML file, empty ones skipped.
fn documents(path: &Path) -> Vec<serde_json::Value> {
    let text = read(path);
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| {
            let v = serde_yaml::Value::deserialize(doc)
                .unwrap_or_else(|e| panic!("{}: not YAML: {e}", path.display()));
            serde_json::to_value(v)
                .unwrap_or_else(|e| panic!("{}: not JSON-like: {e}", path.display()))
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// One manifest, typed.
#[derive(Debug, Clone)]
enum Object {
    StatefulSet(Box<StatefulSet>),
    DaemonSet(Box<DaemonSet>),
    Service(Box<Service>),
    Job(Box<Job>),
    CronJob(Box<CronJob>),
    Secret(Box<Secret>),
    // Typed (so checked) but no invariant reads one.
    #[allow(dead_code)]
    ConfigMap(Box<ConfigMap>),
    PrometheusRule(Box<PrometheusRule>),
    Deployment(Box<Deployment>),
    ServiceAccount(Box<ServiceAccount>),
    Role(Box<Role>),
    RoleBinding(Box<RoleBinding>),
    ClusterRole(Box<ClusterRole>),
    ClusterRoleBinding(Box<ClusterRoleBinding>),
    CustomResourceDefinition(Box<CustomResourceDefinition>),
    NetworkPolicy(Box<NetworkPolicy>),
    // Typed (so checked); the example's invariants read its JSON with the controller's checks.
    #[allow(dead_code)]
    ControlPlaneSet(Box<ControlPlaneSet>),
}

/// prometheus-operator's `PrometheusRule` (monitoring.coreos.com/v1), as much of it as
/// deploy/monitoring uses; k8s-openapi has no type for a custom resource, and an unknown field
/// is refused like everywhere else.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PrometheusRule {
    api_version: String,
    kind: String,
    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    spec: RuleSpec,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleSpec {
    groups: Vec<RuleGroup>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleGroup {
    name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    interval: Option<String>,
    rules: Vec<Rule>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Rule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    alert: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    record: Option<String>,
    expr: String,
    #[serde(rename = "for", default, skip_serializing_if = "Option::is_none")]
    for_: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    annotations: Option<BTreeMap<String, String>>,
}

/// The first places where two JSON values differ (a field the type dropped or rewrote).
fn differences(path: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
    use serde_json::Value::{Array, Object};
    match (a, b) {
        (Object(x), Object(y)) => {
            for k in x.keys().chain(y.keys()).collect::<BTreeSet<_>>() {
                let null = serde_json::Value::Null;
                differences(
                    &format!("{path}.{k}"),
                    x.get(k).unwrap_or(&null),
                    y.get(k).unwrap_or(&null),
                    out,
                );
            }
        }
        (Array(x), Array(y)) if x.len() == y.len() => {
            for (i, (u, v)) in x.iter().zip(y).enumerate() {
                differences(&format!("{path}[{i}]"), u, v, out);
            }
        }
        // The type adds apiVersion and kind to embedded objects (volumeClaimTemplates).
        (serde_json::Value::Null, _)
            if path.ends_with(".apiVersion") || path.ends_with(".kind") => {}
        _ if a != b => out.push(format!("{path}: {a} in the file, {b} after parsing")),
        _ => {}
    }
}

/// `json` as `T`, refusing any field `T` does not know (k8s-openapi ignores unknown fields, so a
/// misspelt `shareProcessNamespce` would otherwise pass unnoticed).
fn strict<T: DeserializeOwned + Serialize>(json: &serde_json::Value) -> Result<T, String> {
    let typed: T = serde_json::from_value(json.clone()).map_err(|e| e.to_string())?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    let mut diff = Vec::new();
    differences("", json, &back, &mut diff);
    if diff.is_empty() {
        Ok(typed)
    } else {
        Err(format!("unknown or malformed fields: {}", diff.join("; ")))
    }
}

/// A manifest into its k8s-openapi type, by apiVersion and kind.
fn typed(json: &serde_json::Value) -> Result<Object, String> {
    let api = json["apiVersion"].as_str().unwrap_or_default();
    let kind = json["kind"].as_str().unwrap_or_default();
    Ok(match (api, kind) {
        ("apps/v1", "StatefulSet") => Object::StatefulSet(Box::new(strict(json)?)),
        ("apps/v1", "DaemonSet") => Object::DaemonSet(Box::new(strict(json)?)),
        ("v1", "Service") => Object::Service(Box::new(strict(json)?)),
        ("batch/v1", "Job") => Object::Job(Box::new(strict(json)?)),
        ("batch/v1", "CronJob") => Object::CronJob(Box::new(strict(json)?)),
        ("v1", "Secret") => Object::Secret(Box::new(strict(json)?)),
        ("v1", "ConfigMap") => Object::ConfigMap(Box::new(strict(json)?)),
        ("monitoring.coreos.com/v1", "PrometheusRule") => {
            Object::PrometheusRule(Box::new(strict(json)?))
        }
        ("apps/v1", "Deployment") => Object::Deployment(Box::new(strict(json)?)),
        ("v1", "ServiceAccount") => Object::ServiceAccount(Box::new(strict(json)?)),
        ("rbac.authorization.k8s.io/v1", "Role") => Object::Role(Box::new(strict(json)?)),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => {
            Object::RoleBinding(Box::new(strict(json)?))
        }
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => {
            Object::ClusterRole(Box::new(strict(json)?))
        }
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            Object::ClusterRoleBinding(Box::new(strict(json)?))
        }
        ("apiextensions.k8s.io/v1", "CustomResourceDefinition") => {
            Object::CustomResourceDefinition(Box::new(strict(json)?))
        }
        ("networking.k8s.io/v1", "NetworkPolicy") => Object::NetworkPolicy(Box::new(strict(json)?)),
        ("etcd-warden.io/v1alpha1", "ControlPlaneSet") => {
            Object::ControlPlaneSet(Box::new(strict(json)?))
        }
        _ => return Err(format!("unexpected apiVersion/kind {api:?}/{kind:?}")),
    })
}

/// One kustomization: its resources, typed, and the ConfigMaps its generators make.
#[derive(Debug, Clone, Default)]
struct Kustomization {
    objects: Vec<Object>,
    /// Generated ConfigMap name → (key → file content).
    config_maps: BTreeMap<String, BTreeMap<String, String>>,
}

/// Loads `dir/kustomization.yaml`, checking every file it names exists and parses. A resource
/// that is a directory is that directory's kustomization, its objects and ConfigMaps added (a
/// generator here of the same name, kustomize's `behavior: replace`, then replaces its data).
fn kustomization(dir: &Path) -> Result<Kustomization, String> {
    let file = dir.join("kustomization.yaml");
    let docs = documents(&file);
    let [k] = docs.as_slice() else {
        return Err(format!("{}: expected one document", file.display()));
    };
    // A Component (deploy/components/) is a kustomization an overlay adds; kustomize knows it
    // only under the alpha API version.
    match (k["kind"].as_str(), k["apiVersion"].as_str()) {
        (Some("Kustomization"), _) => {}
        (Some("Component"), Some("kustomize.config.k8s.io/v1alpha1")) => {}
        (Some("Component"), v) => {
            return Err(format!(
                "{}: a Component's apiVersion is kustomize.config.k8s.io/v1alpha1, not {v:?}",
                file.display()
            ));
        }
        _ => return Err(format!("{}: kind is not Kustomization", file.display())),
    }
    let known = [
        "apiVersion",
        "kind",
        "namespace",
        "labels",
        "resources",
        "configMapGenerator",
        "images",
        "patches",
    ];
    for key in k.as_object().into_iter().flat_map(|o| o.keys()) {
        if !known.contains(&key.as_str()) {
            return Err(format!("{}: unexpected key {key}", file.display()));
        }
    }
    let strings = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_string))
            .collect()
    };
    let mut out = Kustomization::default();
    for resource in strings(&k["resources"]) {
        let path = dir.join(&resource);
        if path.is_dir() {
            let inner = kustomization(&path)?;
            out.objects.extend(inner.objects);
            out.config_maps.extend(inner.config_maps);
            continue;
        }
        if !path.is_file() {
            return Err(format!("{}: resource {resource} missing", file.display()));
        }
        for doc in documents(&path) {
            out.objects
                .push(typed(&doc).map_err(|e| format!("{}: {e}", path.display()))?);
        }
    }
    // A patch (a Component's strategic merge patch) is partial: it must parse and name its
    // target, and is not applied here (what kustomize does with it is not checked).
    for patch in k["patches"].as_array().into_iter().flatten() {
        let rel = patch["path"]
            .as_str()
            .ok_or_else(|| format!("{}: a patch without a path", file.display()))?;
        let path = dir.join(rel);
        if !path.is_file() {
            return Err(format!("{}: patch {rel} missing", file.display()));
        }
        for doc in documents(&path) {
            if doc["kind"].as_str().is_none() || doc["metadata"]["name"].as_str().is_none() {
                return Err(format!(
                    "{}: a patch names no kind and name",
                    path.display()
                ));
            }
        }
    }
    for generator in k["configMapGenerator"].as_array().into_iter().flatten() {
        let name = generator["name"]
            .as_str()
            .ok_or_else(|| format!("{}: generator without name", file.display()))?;
        let mut data = BTreeMap::new();
        for entry in strings(&generator["files"]) {
            // "key=path" or "path" (the key is then the file name).
            let (key, rel) = match entry.split_once('=') {
                Some((k, p)) => (k.to_string(), p.to_string()),
                None => (file_name(&entry), entry.clone()),
            };
            let path = dir.join(&rel);
            if !path.is_file() {
                return Err(format!("{}: generator file {rel} missing", file.display()));
            }
            data.insert(key, read(&path));
        }
        out.config_maps.insert(name.to_string(), data);
    }
    Ok(out)
}

fn file_name(path: &str) -> String {
    Path::new(path)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The example Secrets: name → keys (the files a Secret volume shows).
fn example_secrets() -> BTreeMap<String, BTreeSet<String>> {
    let path = repo().join("deploy/secrets.example.yaml");
    let mut out = BTreeMap::new();
    for doc in documents(&path) {
        let Ok(Object::Secret(s)) = typed(&doc) else {
            panic!("{}: every document must be a Secret", path.display());
        };
        let keys = s.string_data.iter().flat_map(|d| d.keys().cloned());
        let keys = keys.chain(s.data.iter().flat_map(|d| d.keys().cloned()));
        out.insert(s.metadata.name.clone().unwrap_or_default(), keys.collect());
    }
    out
}

/// Expands `$(VAR)` as the kubelet does in env values, command and args.
fn expand(text: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = text.to_string();
    for (k, v) in vars {
        out = out.replace(&format!("$({k})"), v);
    }
    out
}

/// A container's environment as the kubelet would build it (downward API from the constants).
fn environment(c: &Container) -> BTreeMap<String, String> {
    let mut vars = BTreeMap::new();
    for e in c.env.iter().flatten() {
        let value = match (&e.value, &e.value_from) {
            (Some(v), None) => expand(v, &vars),
            // Refused by `secret_env_problems`; a placeholder keeps the other checks going.
            (None, Some(from)) if from.secret_key_ref.is_some() => "<secret>".to_string(),
            (None, Some(from)) => match from.field_ref.as_ref().map(|f| f.field_path.as_str()) {
                Some("metadata.name") => POD_NAME.to_string(),
                Some("metadata.namespace") => POD_NAMESPACE.to_string(),
                other => panic!("env {}: unsupported source {other:?}", e.name),
            },
            _ => panic!("env {}: give value or valueFrom", e.name),
        };
        vars.insert(e.name.clone(), value);
    }
    vars
}

/// A container's command line (command then args), expanded.
fn command_line(c: &Container) -> Vec<String> {
    let vars = environment(c);
    c.command
        .iter()
        .flatten()
        .chain(c.args.iter().flatten())
        .map(|a| expand(a, &vars))
        .collect()
}

/// The value of `--flag=value` on a command line.
fn flag(line: &[String], name: &str) -> Option<String> {
    let prefix = format!("{name}=");
    line.iter()
        .find_map(|a| a.strip_prefix(&prefix).map(str::to_string))
}

/// The value after `--name` (separate argument).
fn arg_after(line: &[String], name: &str) -> Option<String> {
    line.iter()
        .position(|a| a == name)
        .and_then(|i| line.get(i + 1).cloned())
}

fn pod_spec(sts: &StatefulSet) -> &PodSpec {
    sts.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("StatefulSet has a pod spec")
}

/// Every container of a pod, init containers (native sidecars) included.
fn all_containers(pod: &PodSpec) -> impl Iterator<Item = &Container> {
    pod.init_containers.iter().flatten().chain(&pod.containers)
}

/// The container running `etcd-warden serve`.
fn sidecar(pod: &PodSpec) -> Result<&Container, String> {
    let mut serving = all_containers(pod).filter(|c| {
        c.args
            .as_ref()
            .and_then(|a| a.first())
            .is_some_and(|a| a == "serve")
    });
    match (serving.next(), serving.next()) {
        (Some(c), None) => Ok(c),
        _ => Err("exactly one container must run `etcd-warden serve`".into()),
    }
}

/// The etcd container.
fn etcd(pod: &PodSpec) -> Result<&Container, String> {
    pod.containers
        .iter()
        .find(|c| c.name == "etcd")
        .ok_or_else(|| "no container named etcd".to_string())
}

/// The file a container's `--config FILE` names, and its content from the ConfigMap volume
/// mounted at that file's directory.
fn mounted_config(
    pod: &PodSpec,
    c: &Container,
    config_maps: &BTreeMap<String, BTreeMap<String, String>>,
) -> Result<(String, String), String> {
    let line = command_line(c);
    let path = arg_after(&line, "--config")
        .ok_or_else(|| format!("container {}: no --config FILE in its args", c.name))?;
    let dir = Path::new(&path).parent().unwrap_or(Path::new("/"));
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| Path::new(&m.mount_path) == dir)
        .ok_or_else(|| format!("container {}: nothing mounted at {}", c.name, dir.display()))?;
    let map = volume(pod, &mount.name)
        .and_then(|v| v.config_map.as_ref())
        .map(|cm| cm.name.clone())
        .ok_or_else(|| format!("volume {} is not a ConfigMap", mount.name))?;
    let data = config_maps
        .get(&map)
        .ok_or_else(|| format!("ConfigMap {map} is not generated by the kustomization"))?;
    let text = data
        .get(&file_name(&path))
        .ok_or_else(|| format!("ConfigMap {map} has no key {}", file_name(&path)))?;
    Ok((path, text.clone()))
}

/// [`mounted_config`]'s text and the TOML it parses to; the error names the config as `what`
/// (`sidecar`, `copy`, `the Job's`).
fn mounted_toml(
    pod: &PodSpec,
    c: &Container,
    config_maps: &BTreeMap<String, BTreeMap<String, String>>,
    what: &str,
) -> Result<(String, toml::Table), String> {
    let (_, text) =
        mounted_config(pod, c, config_maps).map_err(|e| format!("{what} config: {e}"))?;
    let raw = text
        .parse::<toml::Table>()
        .map_err(|e| format!("{what} config is not TOML: {e}"))?;
    Ok((text, raw))
}

fn volume<'a>(pod: &'a PodSpec, name: &str) -> Option<&'a k8s_openapi::api::core::v1::Volume> {
    pod.volumes.iter().flatten().find(|v| v.name == name)
}

/// Every `*_file` key of a TOML config, as (dotted key, path).
fn file_keys(config: &toml::Table) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (section, value) in config {
        let Some(table) = value.as_table() else {
            continue;
        };
        for (key, v) in table {
            if let (true, Some(path)) = (key.ends_with("_file"), v.as_str()) {
                out.push((format!("{section}.{key}"), path.to_string()));
            }
        }
    }
    out
}

/// Problems with the `*_file` keys of `[section]` among `files`: it must read at least one, each
/// from the Secret `secret` (see [`secret_file_problem`]).
fn section_secret_problems(
    pod: &PodSpec,
    c: &Container,
    files: &[(String, String)],
    section: &str,
    secret: &str,
    secrets: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<String> {
    let prefix = format!("{section}.");
    let mine: Vec<_> = files
        .iter()
        .filter(|(k, _)| k.starts_with(&prefix))
        .collect();
    if mine.is_empty() {
        return vec![format!("[{section}] reads no credentials from {secret}")];
    }
    mine.into_iter()
        .filter_map(|(key, path)| secret_file_problem(pod, c, key, path, Some(secret), secrets))
        .collect()
}

/// Problems with one `*_file` path: it must be a key of the Secret mounted at its directory
/// (`secret`, when given, must be that Secret).
fn secret_file_problem(
    pod: &PodSpec,
    c: &Container,
    key: &str,
    path: &str,
    secret: Option<&str>,
    secrets: &BTreeMap<String, BTreeSet<String>>,
) -> Option<String> {
    let dir = Path::new(path).parent().unwrap_or(Path::new("/"));
    let Some(mount) = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| Path::new(&m.mount_path) == dir)
    else {
        return Some(format!(
            "{key} = {path:?}: container {} mounts nothing at {}",
            c.name,
            dir.display()
        ));
    };
    let Some(name) = volume(pod, &mount.name)
        .and_then(|v| v.secret.as_ref())
        .and_then(|s| s.secret_name.clone())
    else {
        return Some(format!("{key}: volume {} is not a Secret", mount.name));
    };
    if let Some(want) = secret
        && want != name
    {
        return Some(format!("{key}: reads Secret {name}, expected {want}"));
    }
    match secrets.get(&name) {
        None => Some(format!(
            "{key}: Secret {name} missing from secrets.example.yaml"
        )),
        Some(keys) if !keys.contains(&file_name(path)) => Some(format!(
            "{key}: Secret {name} has no key {}",
            file_name(path)
        )),
        Some(_) => None,
    }
}

/// Security problems of one container: non-root, no privilege escalation, read-only root, every
/// capability dropped and only `allowed_add` added.
fn security_problems(pod: &PodSpec, c: &Container, allowed_add: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    let psc = pod.security_context.as_ref();
    let sc = c.security_context.as_ref();
    let non_root = sc
        .and_then(|s| s.run_as_non_root)
        .or(psc.and_then(|s| s.run_as_non_root));
    if non_root != Some(true) {
        out.push(format!("container {}: runAsNonRoot must be true", c.name));
    }
    out.extend(hardening_problems(c, allowed_add));
    out
}

/// [`security_problems`] but the UID: no privilege escalation, read-only root, every
/// capability dropped and only `allowed_add` added.
fn hardening_problems(c: &Container, allowed_add: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    let sc = c.security_context.as_ref();
    if sc.and_then(|s| s.allow_privilege_escalation) != Some(false) {
        out.push(format!(
            "container {}: allowPrivilegeEscalation must be false",
            c.name
        ));
    }
    if sc.and_then(|s| s.read_only_root_filesystem) != Some(true) {
        out.push(format!(
            "container {}: readOnlyRootFilesystem must be true",
            c.name
        ));
    }
    let caps = sc.and_then(|s| s.capabilities.as_ref());
    if !caps
        .and_then(|c| c.drop.as_ref())
        .is_some_and(|d| d.iter().any(|d| d == "ALL"))
    {
        out.push(format!("container {}: must drop ALL capabilities", c.name));
    }
    let added: Vec<&str> = caps
        .and_then(|c| c.add.as_ref())
        .into_iter()
        .flatten()
        .map(String::as_str)
        .collect();
    if added != allowed_add {
        out.push(format!(
            "container {}: capabilities added {added:?}, the kill needs exactly {allowed_add:?}",
            c.name
        ));
    }
    out
}

/// The UID a container runs as (its own setting, else the pod's).
fn uid(pod: &PodSpec, c: &Container) -> Option<i64> {
    c.security_context
        .as_ref()
        .and_then(|s| s.run_as_user)
        .or(pod.security_context.as_ref().and_then(|s| s.run_as_user))
}

/// The port number a probe or Service port names in this pod (a number or a container port name).
fn resolve_port(pod: &PodSpec, port: &IntOrString) -> Option<i32> {
    match port {
        IntOrString::Int(n) => Some(*n),
        IntOrString::String(name) => all_containers(pod)
            .flat_map(|c| c.ports.iter().flatten())
            .find(|p| p.name.as_deref() == Some(name.as_str()))
            .map(|p| p.container_port),
    }
}

/// A dotted key of the effective configuration.
fn get<'a>(config: &'a toml::Table, key: &str) -> Option<&'a toml::Value> {
    let (section, k) = key.split_once('.')?;
    config.get(section)?.as_table()?.get(k)
}

fn get_str<'a>(config: &'a toml::Table, key: &str) -> &'a str {
    get(config, key)
        .and_then(|v| v.as_str())
        .unwrap_or_default()
}

/// Everything wrong with the etcd StatefulSet and its Services, given the sidecar's raw config
/// (as in the ConfigMap) and its effective config (as `etcd-warden config` printed it).
/// Issue 54, item 10: a secret in a container's environment can be read by any process of the
/// same UID from `/proc/<pid>/environ` (deploy/base runs etcd with the sidecar's UID), so
/// secrets come as `*_file` keys from Secret volumes: no `secretKeyRef`, no `envFrom` of a
/// Secret, and no plain value under a name that carries one.
fn secret_env_problems(pod: &PodSpec) -> Vec<String> {
    let secret_name = |name: &str| {
        let n = name.to_ascii_uppercase();
        !(n.ends_with("_FILE") || n.ends_with("_FILES"))
            && (n.contains("SECRET")
                || n.contains("TOKEN")
                || n.contains("PASSWORD")
                || n.ends_with("_KEY"))
    };
    let mut out = Vec::new();
    for c in all_containers(pod) {
        for e in c.env.iter().flatten() {
            let from_secret = e
                .value_from
                .as_ref()
                .is_some_and(|f| f.secret_key_ref.is_some());
            if from_secret || (e.value.is_some() && secret_name(&e.name)) {
                out.push(format!(
                    "container {}: {} is a secret in the environment (readable from \
                     /proc/<pid>/environ by the same UID); mount it from a Secret volume and \
                     name the file (*_file)",
                    c.name, e.name
                ));
            }
        }
        for from in c.env_from.iter().flatten() {
            if let Some(secret) = from.secret_ref.as_ref() {
                out.push(format!(
                    "container {}: envFrom Secret {} puts a secret in the environment; mount \
                     it from a Secret volume instead",
                    c.name, secret.name
                ));
            }
        }
    }
    out
}

/// Every pod spec of every kustomization under deploy/, by where it is.
fn deploy_pods() -> Vec<(String, PodSpec)> {
    let mut out = Vec::new();
    for file in yaml_files(&repo().join("deploy")) {
        if file.file_name().is_none_or(|n| n != "kustomization.yaml") {
            continue;
        }
        let dir = file.parent().expect("dir");
        let k = kustomization(dir).unwrap_or_else(|e| panic!("{e}"));
        for o in k.objects {
            let (what, pod) = match o {
                Object::StatefulSet(s) => (
                    s.metadata.name.clone(),
                    s.spec.and_then(|s| s.template.spec),
                ),
                Object::DaemonSet(d) => (
                    d.metadata.name.clone(),
                    d.spec.and_then(|s| s.template.spec),
                ),
                Object::Deployment(d) => (
                    d.metadata.name.clone(),
                    d.spec.and_then(|s| s.template.spec),
                ),
                Object::Job(j) => (
                    j.metadata.name.clone(),
                    j.spec.and_then(|s| s.template.spec),
                ),
                Object::CronJob(c) => (
                    c.metadata.name.clone(),
                    c.spec
                        .and_then(|s| s.job_template.spec)
                        .and_then(|s| s.template.spec),
                ),
                _ => continue,
            };
            let what = format!("{}: {}", dir.display(), what.unwrap_or_default());
            out.push((what, pod.unwrap_or_else(|| panic!("a pod spec"))));
        }
    }
    out
}

fn statefulset_problems(
    sts: &StatefulSet,
    services: &[Service],
    config_maps: &BTreeMap<String, BTreeMap<String, String>>,
    secrets: &BTreeMap<String, BTreeSet<String>>,
    effective: &toml::Table,
) -> Vec<String> {
    let mut out = Vec::new();
    let pod = pod_spec(sts);
    if pod.share_process_namespace != Some(true) {
        out.push("shareProcessNamespace must be true: the sidecar kills etcd through it".into());
    }
    let (side, etcd) = match (sidecar(pod), etcd(pod)) {
        (Ok(s), Ok(e)) => (s, e),
        (s, e) => {
            out.extend(s.err());
            out.extend(e.err());
            return out;
        }
    };
    let etcd_line = command_line(etcd);

    // Readiness: etcd's probe is the sidecar's /healthz on server.listen's port, which the
    // kubelet reaches on the pod's IP: not on loopback (where no token is needed).
    let listen: Option<SocketAddr> = get_str(effective, "server.listen").parse().ok();
    let listen_port = listen.map(|a| i32::from(a.port()));
    if listen.is_some_and(|a| a.ip().to_canonical().is_loopback()) {
        out.push(format!(
            "server.listen {listen:?} is loopback: neither the kubelet's probe nor the Service \
             reaches it"
        ));
    }
    match etcd
        .readiness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
    {
        None => out.push("etcd has no httpGet readiness probe".into()),
        Some(get) => {
            if get.path.as_deref() != Some("/healthz") {
                out.push(format!(
                    "etcd's readiness probe path is {:?}, not /healthz",
                    get.path
                ));
            }
            if resolve_port(pod, &get.port) != listen_port || listen_port.is_none() {
                out.push(format!(
                    "etcd's readiness probe port {:?} is not server.listen's port {listen_port:?}",
                    get.port
                ));
            }
        }
    }
    let side_ports: Vec<i32> = side
        .ports
        .iter()
        .flatten()
        .map(|p| p.container_port)
        .collect();
    if listen_port.is_none_or(|p| !side_ports.contains(&p)) {
        out.push(format!(
            "the sidecar declares ports {side_ports:?}, not server.listen's {listen_port:?}"
        ));
    }

    // The config file the sidecar reads, the Secret files it names, and what `serve` requires
    // of it (beyond loopback, the bearer token of POST /snapshot/*).
    match mounted_toml(pod, side, config_maps, "sidecar") {
        Err(e) => out.push(e),
        Ok((text, raw)) => {
            for (key, path) in file_keys(&raw) {
                out.extend(secret_file_problem(pod, side, &key, &path, None, secrets));
            }
            out.extend(subcommand_config_problem(side, &text));
        }
    }

    // Capabilities: none when both run as one UID; otherwise KILL on the sidecar only.
    let same_uid = matches!((uid(pod, side), uid(pod, etcd)), (Some(a), Some(b)) if a == b);
    let side_caps: &[&str] = if same_uid { &[] } else { &["KILL"] };
    out.extend(security_problems(pod, side, side_caps));
    out.extend(security_problems(pod, etcd, &[]));

    // The kill finds this etcd: its comm (the executable's name, 15 bytes) and command line.
    let matcher = etcd_warden::kill::Matcher {
        name: get_str(effective, "kill.process_name").to_string(),
        cmdline_contains: get(effective, "kill.cmdline_contains")
            .and_then(|v| v.as_str())
            .map(str::to_string),
    };
    let exe = etcd_line.first().map(|p| file_name(p)).unwrap_or_default();
    let comm: String = exe.chars().take(15).collect();
    let cmdline = etcd_line.join("\0");
    if !matcher.matches(&comm, cmdline.as_bytes()) {
        out.push(format!(
            "the kill settings {matcher:?} do not match etcd's command line {etcd_line:?}"
        ));
    }

    // etcd.endpoints: the member in this pod.
    let client_port = flag(&etcd_line, "--listen-client-urls")
        .and_then(|u| url::Url::parse(&u).ok())
        .and_then(|u| u.port());
    let endpoints: Vec<url::Url> = get(effective, "etcd.endpoints")
        .and_then(|v| v.as_array())
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().and_then(|s| url::Url::parse(s).ok()))
        .collect();
    if endpoints.is_empty()
        || endpoints
            .iter()
            .any(|u| u.host_str() != Some("127.0.0.1") || u.port() != client_port)
    {
        out.push(format!(
            "etcd.endpoints must be this pod's member on 127.0.0.1:{client_port:?}"
        ));
    }

    // The data directory: one volume in both containers, and what a restore builds.
    let data_dir = flag(&etcd_line, "--data-dir").unwrap_or_default();
    let data_mount = |c: &Container| {
        c.volume_mounts
            .iter()
            .flatten()
            .find(|m| Path::new(&data_dir).parent() == Some(Path::new(&m.mount_path)))
            .map(|m| m.name.clone())
    };
    let initialize = get(effective, "restore.initialize").and_then(|v| v.as_bool()) == Some(true);
    match data_mount(etcd) {
        None => out.push(format!(
            "etcd's --data-dir {data_dir:?} must be a directory directly inside a volume mount"
        )),
        Some(name) => {
            let claimed = sts
                .spec
                .as_ref()
                .and_then(|s| s.volume_claim_templates.as_ref())
                .into_iter()
                .flatten()
                .any(|t| t.metadata.name.as_deref() == Some(name.as_str()));
            if !claimed {
                out.push(format!("volume {name} has no volumeClaimTemplate"));
            }
            if initialize && data_mount(side) != Some(name) {
                out.push("restore.initialize: the sidecar must mount etcd's data volume".into());
            }
        }
    }
    if initialize {
        // etcd must not start before the restore: only a native sidecar with a startup probe
        // holds the regular containers back.
        let native = pod
            .init_containers
            .iter()
            .flatten()
            .any(|c| c.name == side.name && c.restart_policy.as_deref() == Some("Always"));
        if !native || side.startup_probe.is_none() {
            out.push(
                "restore.initialize needs the sidecar as a native sidecar (init container, \
                 restartPolicy Always) with a startup probe, or etcd starts before the restore"
                    .into(),
            );
        }
        let side_env = environment(side);
        let restored = |key: &str| {
            expand(
                get(effective, key).and_then(|v| v.as_str()).unwrap_or(""),
                &side_env,
            )
        };
        for (key, etcd_flag) in [
            ("restore.data_dir", "--data-dir"),
            ("restore.name", "--name"),
            ("restore.initial_cluster", "--initial-cluster"),
            ("restore.initial_cluster_token", "--initial-cluster-token"),
            (
                "restore.initial_advertise_peer_urls",
                "--initial-advertise-peer-urls",
            ),
        ] {
            let ours = restored(key);
            let theirs = flag(&etcd_line, etcd_flag).unwrap_or_default();
            if ours != theirs {
                out.push(format!(
                    "{key} = {ours:?} but etcd's {etcd_flag} is {theirs:?}"
                ));
            }
        }
    }

    // Services: selectors match the pods, ports exist, the peer Service is headless, and the
    // sidecar's API stays reachable while etcd is unready (after a deactivation).
    let labels = sts
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    let service_name = sts.spec.as_ref().and_then(|s| s.service_name.clone());
    let client_port = resolve_port(pod, &IntOrString::String("client".into()));
    out.extend(secret_env_problems(pod));
    let mut peer_ok = false;
    let mut api_ok = false;
    for svc in services {
        let name = svc.metadata.name.clone().unwrap_or_default();
        let Some(spec) = svc.spec.as_ref() else {
            out.push(format!("Service {name} has no spec"));
            continue;
        };
        let selector = spec.selector.clone().unwrap_or_default();
        if selector.is_empty() || selector.iter().any(|(k, v)| labels.get(k) != Some(v)) {
            out.push(format!("Service {name}: selector does not match the pods"));
        }
        let not_ready = spec.publish_not_ready_addresses == Some(true);
        for port in spec.ports.iter().flatten() {
            let target = port
                .target_port
                .clone()
                .unwrap_or(IntOrString::Int(port.port));
            match resolve_port(pod, &target) {
                None => out.push(format!(
                    "Service {name}: target port {target:?} not in the pod"
                )),
                Some(p) if Some(p) == client_port && not_ready => out.push(format!(
                    "Service {name} publishes etcd's client port {p} of not-ready pods: \
                     readiness is the fence, clients reach etcd through ready members only"
                )),
                Some(p) if Some(p) == listen_port && not_ready => api_ok = true,
                Some(_) => {}
            }
        }
        if service_name.as_deref() == Some(name.as_str()) {
            peer_ok = spec.cluster_ip.as_deref() == Some("None") && not_ready;
        }
    }
    if !peer_ok {
        out.push(format!(
            "the StatefulSet's serviceName {service_name:?} must be a headless Service with \
             publishNotReadyAddresses"
        ));
    }
    if !api_ok {
        out.push(
            "no Service with publishNotReadyAddresses reaches the sidecar's port: \
             /snapshot/latest would vanish exactly when the migration polls it"
                .into(),
        );
    }
    out
}

/// Everything wrong with the copy Job, given its raw and effective config.
fn job_problems(
    job: &Job,
    config_maps: &BTreeMap<String, BTreeMap<String, String>>,
    secrets: &BTreeMap<String, BTreeSet<String>>,
    effective: &toml::Table,
) -> Vec<String> {
    let mut out = Vec::new();
    let Some(pod) = job.spec.as_ref().and_then(|s| s.template.spec.as_ref()) else {
        return vec!["Job has no pod spec".into()];
    };
    let [c] = pod.containers.as_slice() else {
        return vec!["the copy Job has exactly one container".into()];
    };
    let line = command_line(c);
    if line.first().map(String::as_str) != Some("copy") {
        out.push(format!("the Job runs {line:?}, not `copy`"));
    }
    if !line.iter().any(|a| a == "--wait-for-final") {
        out.push("the copy Job must wait for the final snapshot (--wait-for-final)".into());
    }
    match mounted_toml(pod, c, config_maps, "copy") {
        Err(e) => out.push(e),
        Ok((text, raw)) => {
            let files = file_keys(&raw);
            for (section, secret) in [
                ("source_store", "source-etcd-backup"),
                ("store", "etcd-backup"),
            ] {
                out.extend(section_secret_problems(
                    pod, c, &files, section, secret, secrets,
                ));
            }
            out.extend(subcommand_config_problem(c, &text));
        }
    }
    if get(effective, "source_store.url").is_none() {
        out.push("the copy config has no [source_store]".into());
    }
    let timeout = humantime::parse_duration(get_str(effective, "copy.final_timeout"))
        .map(|d| d.as_secs())
        .unwrap_or(u64::MAX);
    let deadline = job
        .spec
        .as_ref()
        .and_then(|s| s.active_deadline_seconds)
        .and_then(|d| u64::try_from(d).ok());
    if deadline.is_some_and(|d| d <= timeout) {
        out.push(format!(
            "activeDeadlineSeconds {deadline:?} ends the Job before copy.final_timeout ({timeout}s)"
        ));
    }
    out.extend(security_problems(pod, c, &[]));
    out
}

/// A config file as a container would see it, written into `dir`: each `*_file` (a Secret file
/// in the pod) replaced by a file of the same name in `dir`. Returns the config file's path.
fn local_config(dir: &Path, text: &str) -> PathBuf {
    let mut raw: toml::Table = text.parse().expect("config is TOML");
    for (dotted, path) in file_keys(&raw) {
        let (section, key) = dotted.split_once('.').expect("dotted");
        let local = dir.join(section).join(file_name(&path));
        std::fs::create_dir_all(local.parent().expect("parent")).expect("mkdir");
        std::fs::write(&local, "placeholder").expect("write secret file");
        let table = raw
            .get_mut(section)
            .and_then(|t| t.as_table_mut())
            .expect("section");
        table.insert(key.into(), toml::Value::String(local.display().to_string()));
    }
    let file = dir.join("config.toml");
    std::fs::write(&file, toml::to_string(&raw).expect("TOML")).expect("write config");
    file
}

/// Whether the container's subcommand would start on this config: what it requires beyond any
/// use (`serve`: a token when listening beyond loopback; `copy`: a source store) is validated
/// as the binary validates it, with the container's environment.
fn subcommand_config_problem(c: &Container, text: &str) -> Option<String> {
    let line = command_line(c);
    let (subcommand, purpose) = match line.first().map(String::as_str) {
        Some("serve") => ("serve", Purpose::Serve),
        Some("copy") => ("copy", Purpose::Copy),
        Some("restore") => ("restore", Purpose::Restore),
        Some("compact") => ("compact", Purpose::Any),
        _ => ("(other)", Purpose::Any),
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let file = local_config(dir.path(), text);
    let env: HashMap<String, String> = environment(c).into_iter().collect();
    let sources = Sources {
        file: Some(&file),
        env: &env,
        overrides: vec![],
    };
    Config::load_for(&sources, purpose).err().map(|e| {
        format!(
            "`etcd-warden {subcommand}` in {} refuses to start: {e}",
            c.name
        )
    })
}

/// Runs the real `etcd-warden config` on a config file as `c` would see it: its environment, and
/// each `*_file` (a Secret file in the pod) replaced by a file of the same name in a temp dir.
/// Returns the effective configuration it prints.
fn effective_config(c: &Container, text: &str) -> toml::Table {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = local_config(dir.path(), text);
    let out = support::warden::command()
        .arg("config")
        .arg("--config")
        .arg(&file)
        .envs(environment(c))
        .output()
        .expect("run etcd-warden config");
    assert!(
        out.status.success(),
        "`etcd-warden config` rejects the config of container {} ({}):\n{}",
        c.name,
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .parse()
        .expect("`etcd-warden config` prints TOML")
}

struct Base {
    sts: StatefulSet,
    services: Vec<Service>,
    policies: Vec<NetworkPolicy>,
    config_maps: BTreeMap<String, BTreeMap<String, String>>,
    effective: toml::Table,
}

fn base() -> Base {
    let k = kustomization(&repo().join("deploy/base")).unwrap_or_else(|e| panic!("{e}"));
    let mut sts = None;
    let mut services = Vec::new();
    let mut policies = Vec::new();
    for o in k.objects {
        match o {
            Object::StatefulSet(s) => {
                assert!(sts.is_none(), "one StatefulSet in deploy/base");
                sts = Some(*s);
            }
            Object::Service(s) => services.push(*s),
            Object::NetworkPolicy(p) => policies.push(*p),
            other => panic!("deploy/base: unexpected {other:?}"),
        }
    }
    let sts = sts.expect("deploy/base has a StatefulSet");
    let pod = pod_spec(&sts);
    let side = sidecar(pod).unwrap_or_else(|e| panic!("{e}"));
    let (_, text) = mounted_config(pod, side, &k.config_maps).unwrap_or_else(|e| panic!("{e}"));
    let effective = effective_config(side, &text);
    Base {
        sts,
        services,
        policies,
        config_maps: k.config_maps,
        effective,
    }
}

struct CopyJob {
    job: Job,
    config_maps: BTreeMap<String, BTreeMap<String, String>>,
    effective: toml::Table,
}

fn copy_job() -> CopyJob {
    let k = kustomization(&repo().join("deploy/copy-job")).unwrap_or_else(|e| panic!("{e}"));
    let jobs: Vec<Job> = k
        .objects
        .into_iter()
        .map(|o| match o {
            Object::Job(j) => *j,
            other => panic!("deploy/copy-job: unexpected {other:?}"),
        })
        .collect();
    let [job] = <[Job; 1]>::try_from(jobs).expect("one Job in deploy/copy-job");
    let pod = job
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod spec");
    let c = pod.containers.first().expect("a container");
    let (_, text) = mounted_config(pod, c, &k.config_maps).unwrap_or_else(|e| panic!("{e}"));
    let effective = effective_config(c, &text);
    CopyJob {
        job,
        config_maps: k.config_maps,
        effective,
    }
}

#[test]
fn every_manifest_parses_into_its_kubernetes_type() {
    let files = yaml_files(&repo().join("deploy"));
    assert!(
        files.len() >= 6,
        "deploy/ holds too few manifests: {files:?}"
    );
    let mut kustomizations = 0;
    // A Component's patches are partial objects, checked by `kustomization`.
    let patches: Vec<std::path::PathBuf> = files
        .iter()
        .filter(|f| f.file_name().is_some_and(|n| n == "kustomization.yaml"))
        .flat_map(|f| {
            let dir = f.parent().expect("dir").to_path_buf();
            documents(f)
                .into_iter()
                .flat_map(|k| k["patches"].as_array().cloned().unwrap_or_default())
                .filter_map(move |p| p["path"].as_str().map(|rel| dir.join(rel)))
        })
        .collect();
    for file in &files {
        if patches.contains(file) {
            continue;
        }
        if file.file_name().is_some_and(|n| n == "kustomization.yaml") {
            let dir = file.parent().expect("dir");
            kustomization(dir).unwrap_or_else(|e| panic!("{e}"));
            kustomizations += 1;
            continue;
        }
        let docs = documents(file);
        assert!(!docs.is_empty(), "{}: empty", file.display());
        for doc in docs {
            typed(&doc).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        }
    }
    assert_eq!(
        kustomizations, 10,
        "deploy/base, deploy/copy-job, deploy/compact-job, deploy/drill-job, deploy/druid, \
         deploy/kubeadm, deploy/monitoring, deploy/operator, deploy/components/etcd-3.6 and \
         deploy/components/kubernetes-face"
    );
}

/// Issue 45, item 5: under etcd-druid the snapshot triggers answer anyone who reaches the port,
/// so deploy/druid's NetworkPolicy admits to it only druid and the Etcd's own pods (the leader
/// forwarding), and leaves every other port (etcd's client and peer ports among them) as it was. What it cannot check:
/// that the labels are those of a given druid installation, or that the cluster's network
/// plugin enforces NetworkPolicies at all.
#[test]
fn the_druid_network_policy_admits_only_druid_and_the_etcd_pods_to_the_backup_port() {
    let k = kustomization(&repo().join("deploy/druid")).unwrap_or_else(|e| panic!("{e}"));
    let policies: Vec<&NetworkPolicy> = k
        .objects
        .iter()
        .filter_map(|o| match o {
            Object::NetworkPolicy(p) => Some(p.as_ref()),
            _ => None,
        })
        .collect();
    assert_eq!(policies.len(), 1, "deploy/druid holds one NetworkPolicy");
    let spec = policies[0].spec.as_ref().expect("spec");
    let etcd_pods = BTreeMap::from([(
        "app.kubernetes.io/part-of".to_string(),
        "etcd-main".to_string(),
    )]);
    assert_eq!(
        spec.pod_selector
            .as_ref()
            .and_then(|s| s.match_labels.as_ref()),
        Some(&etcd_pods)
    );
    assert_eq!(
        spec.policy_types.as_deref(),
        Some(&["Ingress".to_string()][..])
    );
    let rules = spec.ingress.as_deref().unwrap_or_default();
    // The TCP ports a rule names, ranges (endPort) expanded.
    let ports_of = |p: &k8s_openapi::api::networking::v1::NetworkPolicyPort| {
        assert_eq!(p.protocol.as_deref(), Some("TCP"), "{p:?}");
        let first = match &p.port {
            Some(IntOrString::Int(n)) => *n,
            other => panic!("a port by number, not {other:?}"),
        };
        first..=p.end_port.unwrap_or(first)
    };
    let mut backup_peers = Vec::new();
    let mut open_ports = BTreeSet::new();
    for rule in rules {
        // A rule without ports admits every port, the backup port with it.
        let ports: BTreeSet<i32> = rule
            .ports
            .as_deref()
            .expect("every rule names its ports")
            .iter()
            .flat_map(ports_of)
            .collect();
        let from = rule.from.as_deref().unwrap_or_default();
        if ports.contains(&8080) {
            assert!(!from.is_empty(), "port 8080 open to everyone");
            backup_peers.extend(from.iter().cloned());
        } else if from.is_empty() {
            open_ports.extend(ports);
        }
    }
    // The policy closes 8080 and nothing else: every other port (etcd's client and peer ports,
    // etcd-wrapper's, etcd's metrics) stays open to everyone, as without it.
    let others: BTreeSet<i32> = (1..=65535).filter(|p| *p != 8080).collect();
    assert!(
        open_ports == others,
        "ports other than 8080 closed by the policy: {:?}",
        others.difference(&open_ports).take(10).collect::<Vec<_>>()
    );
    let mut admitted = Vec::new();
    for peer in &backup_peers {
        assert!(
            peer.ip_block.is_none(),
            "an address range admitted to 8080: {peer:?}"
        );
        let pods = peer
            .pod_selector
            .as_ref()
            .and_then(|s| s.match_labels.clone())
            .unwrap_or_default();
        assert!(
            !pods.is_empty(),
            "every pod admitted to 8080 is selected by labels: {peer:?}"
        );
        let namespace = peer
            .namespace_selector
            .as_ref()
            .map(|n| n.match_labels.clone());
        admitted.push((namespace, pods));
    }
    let druid = BTreeMap::from([(
        "app.kubernetes.io/name".to_string(),
        "etcd-druid".to_string(),
    )]);
    assert_eq!(admitted.len(), 2, "{admitted:?}");
    assert!(
        admitted.contains(&(None, etcd_pods.clone())),
        "the Etcd's own pods (same namespace): {admitted:?}"
    );
    assert!(
        admitted
            .iter()
            .any(|(ns, pods)| ns.is_some() && *pods == druid),
        "etcd-druid, in its namespace: {admitted:?}"
    );
}

#[test]
fn a_misspelt_field_is_not_silently_dropped() {
    let mut doc = documents(&repo().join("deploy/base/statefulset.yaml")).remove(0);
    doc["spec"]["template"]["spec"]["shareProcessNamespce"] = serde_json::Value::Bool(true);
    let err = typed(&doc).expect_err("an unknown field must be refused");
    assert!(err.contains("shareProcessNamespce"), "{err}");
}

#[test]
fn a_kustomization_naming_a_missing_file_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    // Every file of deploy/base but config.toml, which the generator names.
    for entry in std::fs::read_dir(repo().join("deploy/base")).expect("list deploy/base") {
        let path = entry.expect("list deploy/base").path();
        if path.file_name().is_some_and(|n| n != "config.toml") && path.is_file() {
            std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).expect("copy");
        }
    }
    let err = kustomization(dir.path()).expect_err("missing generator file");
    assert!(err.contains("config.toml"), "{err}");
}

/// Issue 54, item 10: no manifest under deploy/ (base, druid, the Jobs, the operator) puts a
/// secret in a container's environment.
#[test]
fn no_manifest_puts_a_secret_in_the_environment() {
    let pods = deploy_pods();
    assert!(
        pods.len() >= 5,
        "{:?}",
        pods.iter().map(|p| &p.0).collect::<Vec<_>>()
    );
    for (what, pod) in &pods {
        let problems = secret_env_problems(pod);
        assert!(problems.is_empty(), "{what}: {problems:#?}");
    }
}

/// Issue 54, item 13: deploy/base's etcd listens on plain HTTP, and readiness is the fence:
/// its NetworkPolicy admits to etcd's client port only the kube-apiserver's pods (by labels)
/// and etcd's own, to the peer port only etcd's pods, and the peer Service (which publishes
/// not-ready pods) has no client port. What it cannot check: that the kube-apiserver's labels
/// are your installation's, or that the network plugin enforces NetworkPolicies.
#[test]
fn the_base_network_policy_fences_etcds_client_and_peer_ports() {
    let b = base();
    let pod = pod_spec(&b.sts);
    let labels = b
        .sts
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    let selects_etcd =
        |s: &Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector>| {
            s.as_ref()
                .and_then(|s| s.match_labels.as_ref())
                .is_some_and(|m| !m.is_empty() && m.iter().all(|(k, v)| labels.get(k) == Some(v)))
        };
    let client = resolve_port(pod, &IntOrString::String("client".into())).expect("client port");
    let peer = resolve_port(pod, &IntOrString::String("peer".into())).expect("peer port");
    let policies: Vec<&NetworkPolicy> = b
        .policies
        .iter()
        .filter(|p| {
            p.spec.as_ref().is_some_and(|s| {
                selects_etcd(&s.pod_selector)
                    && s.policy_types.iter().flatten().any(|t| t == "Ingress")
            })
        })
        .collect();
    assert!(
        !policies.is_empty(),
        "deploy/base has no NetworkPolicy selecting etcd's pods for ingress"
    );
    let mut admitted: BTreeMap<i32, usize> = BTreeMap::new();
    for p in &policies {
        for rule in p
            .spec
            .as_ref()
            .and_then(|s| s.ingress.as_ref())
            .into_iter()
            .flatten()
        {
            let covers = |port: i32| match rule.ports.as_ref() {
                None => true,
                Some(ports) => ports.iter().any(|pp| {
                    let from = pp.port.as_ref().and_then(|x| resolve_port(pod, x));
                    match (from, pp.end_port) {
                        (None, _) => pp.port.is_none(),
                        (Some(f), None) => f == port,
                        (Some(f), Some(e)) => (f..=e).contains(&port),
                    }
                }),
            };
            for port in [client, peer] {
                if !covers(port) {
                    continue;
                }
                let from = rule.from.as_ref();
                assert!(
                    from.is_some_and(|f| !f.is_empty()),
                    "port {port} is open to everyone: {rule:?}"
                );
                for source in from.into_iter().flatten() {
                    assert!(
                        source.ip_block.is_none(),
                        "an address range on {port}: {source:?}"
                    );
                    let pods = source
                        .pod_selector
                        .as_ref()
                        .and_then(|s| s.match_labels.as_ref())
                        .is_some_and(|m| !m.is_empty());
                    assert!(
                        pods,
                        "port {port}: every source is selected by pod labels: {source:?}"
                    );
                    if port == peer {
                        assert!(
                            selects_etcd(&source.pod_selector)
                                && source.namespace_selector.is_none(),
                            "the peer port admits only etcd's pods: {source:?}"
                        );
                    }
                    *admitted.entry(port).or_default() += 1;
                }
            }
        }
    }
    assert!(
        admitted.contains_key(&client) && admitted.contains_key(&peer),
        "{admitted:?}"
    );
    // The peer Service publishes not-ready pods: never their client port.
    for svc in &b.services {
        let Some(spec) = svc.spec.as_ref() else {
            continue;
        };
        if spec.publish_not_ready_addresses != Some(true) {
            continue;
        }
        for port in spec.ports.iter().flatten() {
            let target = port
                .target_port
                .clone()
                .unwrap_or(IntOrString::Int(port.port));
            assert_ne!(
                resolve_port(pod, &target),
                Some(client),
                "Service {:?} publishes etcd's client port of not-ready pods",
                svc.metadata.name
            );
        }
    }
}

#[test]
fn the_base_statefulset_holds_the_sidecar_invariants() {
    let b = base();
    let problems = statefulset_problems(
        &b.sts,
        &b.services,
        &b.config_maps,
        &example_secrets(),
        &b.effective,
    );
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn a_broken_statefulset_is_rejected() {
    let b = base();
    let secrets = example_secrets();
    fn pod(s: &mut StatefulSet) -> &mut PodSpec {
        s.spec
            .as_mut()
            .and_then(|s| s.template.spec.as_mut())
            .expect("pod spec")
    }
    fn etcd_of(p: &mut PodSpec) -> &mut Container {
        p.containers
            .iter_mut()
            .find(|c| c.name == "etcd")
            .expect("etcd")
    }
    fn sidecar_of(s: &mut StatefulSet) -> &mut Container {
        pod(s)
            .init_containers
            .as_mut()
            .and_then(|c| c.first_mut())
            .expect("sidecar")
    }
    /// The sidecar's mount of volume `volume` moved to `path`.
    fn move_mount(s: &mut StatefulSet, volume: &str, path: &str) {
        for m in sidecar_of(s).volume_mounts.iter_mut().flatten() {
            if m.name == volume {
                m.mount_path = path.into();
            }
        }
    }
    type Mutation = Box<dyn Fn(&mut StatefulSet, &mut Vec<Service>)>;
    let mutations: Vec<(&str, &str, Mutation)> = vec![
        (
            "no shared PID namespace",
            "shareProcessNamespace",
            Box::new(|s, _| pod(s).share_process_namespace = Some(false)),
        ),
        (
            "probe on another port",
            "readiness probe port",
            Box::new(|s, _| {
                let get = etcd_of(pod(s))
                    .readiness_probe
                    .as_mut()
                    .and_then(|p| p.http_get.as_mut())
                    .expect("httpGet");
                get.port = IntOrString::Int(8081);
            }),
        ),
        (
            "probe on /livez",
            "not /healthz",
            Box::new(|s, _| {
                let get = etcd_of(pod(s))
                    .readiness_probe
                    .as_mut()
                    .and_then(|p| p.http_get.as_mut())
                    .expect("httpGet");
                get.path = Some("/livez".into());
            }),
        ),
        (
            "CAP_KILL although the UIDs match",
            "capabilities added",
            Box::new(|s, _| {
                let caps = sidecar_of(s)
                    .security_context
                    .as_mut()
                    .and_then(|s| s.capabilities.as_mut())
                    .expect("capabilities");
                caps.add = Some(vec!["KILL".into()]);
            }),
        ),
        (
            "etcd as another UID without CAP_KILL",
            "the kill needs exactly [\"KILL\"]",
            Box::new(|s, _| {
                let etcd = etcd_of(pod(s));
                etcd.security_context
                    .as_mut()
                    .expect("security context")
                    .run_as_user = Some(1000);
            }),
        ),
        (
            "another data dir",
            "kill settings",
            Box::new(|s, _| {
                for a in etcd_of(pod(s)).args.iter_mut().flatten() {
                    if a.starts_with("--data-dir=") {
                        *a = "--data-dir=/var/lib/etcd/member0".into();
                    }
                }
            }),
        ),
        (
            "config mounted elsewhere",
            "sidecar config",
            Box::new(|s, _| move_mount(s, "config", "/config")),
        ),
        (
            "Secret mounted elsewhere",
            "access_key_id_file",
            Box::new(|s, _| move_mount(s, "etcd-backup", "/var/etcd-backup")),
        ),
        (
            "sidecar as an ordinary container",
            "native sidecar",
            Box::new(|s, _| {
                let p = pod(s);
                let side = p.init_containers.take().expect("init").remove(0);
                p.containers.push(Container {
                    restart_policy: None,
                    ..side
                });
            }),
        ),
        (
            "writable root filesystem",
            "readOnlyRootFilesystem",
            Box::new(|s, _| {
                etcd_of(pod(s))
                    .security_context
                    .as_mut()
                    .expect("security context")
                    .read_only_root_filesystem = Some(false);
            }),
        ),
        (
            "API Service drops unready pods",
            "/snapshot/latest would vanish",
            Box::new(|_, services| {
                for svc in services.iter_mut() {
                    if let Some(spec) = svc.spec.as_mut()
                        && spec.cluster_ip.as_deref() != Some("None")
                    {
                        spec.publish_not_ready_addresses = None;
                    }
                }
            }),
        ),
        (
            "the store's secret key from the environment",
            "secret in the environment",
            Box::new(|s, _| {
                let from = k8s_openapi::api::core::v1::EnvVarSource {
                    secret_key_ref: Some(k8s_openapi::api::core::v1::SecretKeySelector {
                        name: "etcd-backup".into(),
                        key: "secretAccessKey".into(),
                        optional: None,
                    }),
                    ..Default::default()
                };
                sidecar_of(s).env.get_or_insert_with(Vec::new).push(
                    k8s_openapi::api::core::v1::EnvVar {
                        name: "ETCD_WARDEN_STORE_SECRET_ACCESS_KEY".into(),
                        value: None,
                        value_from: Some(from),
                    },
                );
            }),
        ),
        (
            "the token as a plain value",
            "secret in the environment",
            Box::new(|s, _| {
                sidecar_of(s).env.get_or_insert_with(Vec::new).push(
                    k8s_openapi::api::core::v1::EnvVar {
                        name: "ETCD_WARDEN_SERVER_TOKEN".into(),
                        value: Some("t0ken".into()),
                        value_from: None,
                    },
                );
            }),
        ),
        (
            "a Secret as the whole environment",
            "secret in the environment",
            Box::new(|s, _| {
                sidecar_of(s).env_from = Some(vec![k8s_openapi::api::core::v1::EnvFromSource {
                    secret_ref: Some(k8s_openapi::api::core::v1::SecretEnvSource {
                        name: "etcd-backup".into(),
                        optional: None,
                    }),
                    ..Default::default()
                }]);
            }),
        ),
        (
            "the peer Service publishing the client port",
            "client port 2379 of not-ready pods",
            Box::new(|_, services| {
                for svc in services.iter_mut() {
                    if let Some(spec) = svc.spec.as_mut()
                        && spec.cluster_ip.as_deref() == Some("None")
                    {
                        spec.ports.get_or_insert_with(Vec::new).push(
                            k8s_openapi::api::core::v1::ServicePort {
                                name: Some("client".into()),
                                port: 2379,
                                target_port: Some(IntOrString::String("client".into())),
                                ..Default::default()
                            },
                        );
                    }
                }
            }),
        ),
    ];
    for (what, expected, mutate) in mutations {
        let mut sts = b.sts.clone();
        let mut services = b.services.clone();
        mutate(&mut sts, &mut services);
        let problems =
            statefulset_problems(&sts, &services, &b.config_maps, &secrets, &b.effective);
        assert!(
            problems.iter().any(|p| p.contains(expected)),
            "{what}: expected a problem mentioning {expected:?}, got {problems:#?}"
        );
    }
}

#[test]
fn the_sidecar_listens_beyond_loopback_only_with_a_token() {
    let b = base();
    let secrets = example_secrets();
    let listen: SocketAddr = get_str(&b.effective, "server.listen")
        .parse()
        .expect("address");
    assert!(!listen.ip().is_loopback(), "the probe reaches {listen}");
    assert!(get(&b.effective, "server.token_file").is_some());

    let edit = |from: &str, to: &str| {
        let mut maps = b.config_maps.clone();
        let mut edited = false;
        for text in maps.values_mut().flat_map(|m| m.values_mut()) {
            if text.contains(from) {
                *text = text.replace(from, to);
                edited = true;
            }
        }
        assert!(edited, "no config holds {from:?}");
        statefulset_problems(&b.sts, &b.services, &maps, &secrets, &b.effective)
    };
    let problems = edit("token_file = ", "# token_file = ");
    assert!(
        problems.iter().any(|p| p.contains("`etcd-warden serve` in")
            && p.contains("server.token: required when server.listen")),
        "{problems:#?}"
    );

    let mut effective = b.effective.clone();
    effective["server"]["listen"] = toml::Value::String("127.0.0.1:8080".into());
    let problems = statefulset_problems(&b.sts, &b.services, &b.config_maps, &secrets, &effective);
    assert!(
        problems.iter().any(|p| p.contains("is loopback")),
        "{problems:#?}"
    );
}

#[test]
fn the_copy_job_waits_for_the_final_snapshot_with_both_store_secrets() {
    let j = copy_job();
    let secrets = example_secrets();
    let problems = job_problems(&j.job, &j.config_maps, &secrets, &j.effective);
    assert!(problems.is_empty(), "{problems:#?}");

    fn container(job: &mut Job) -> &mut Container {
        job.spec
            .as_mut()
            .and_then(|s| s.template.spec.as_mut())
            .and_then(|p| p.containers.first_mut())
            .expect("container")
    }
    let mut no_wait = j.job.clone();
    container(&mut no_wait)
        .args
        .as_mut()
        .expect("args")
        .retain(|a| a != "--wait-for-final");
    let problems = job_problems(&no_wait, &j.config_maps, &secrets, &j.effective);
    assert!(
        problems.iter().any(|p| p.contains("--wait-for-final")),
        "{problems:#?}"
    );

    let mut swapped = j.job.clone();
    for m in container(&mut swapped).volume_mounts.iter_mut().flatten() {
        m.mount_path = match m.mount_path.as_str() {
            "/etc/etcd-backup" => "/etc/source-etcd-backup".into(),
            "/etc/source-etcd-backup" => "/etc/etcd-backup".into(),
            other => other.into(),
        };
    }
    let problems = job_problems(&swapped, &j.config_maps, &secrets, &j.effective);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("expected source-etcd-backup")),
        "{problems:#?}"
    );

    let mut short = j.job.clone();
    short.spec.as_mut().expect("spec").active_deadline_seconds = Some(600);
    let problems = job_problems(&short, &j.config_maps, &secrets, &j.effective);
    assert!(
        problems.iter().any(|p| p.contains("activeDeadlineSeconds")),
        "{problems:#?}"
    );
}

#[test]
fn the_containerfile_builds_every_binary_and_carries_the_deployed_etcd() {
    let containerfile = read(&repo().join("Containerfile"));
    let version = containerfile
        .lines()
        .find_map(|l| l.trim().strip_prefix("ARG ETCD_VERSION="))
        .expect("Containerfile: ARG ETCD_VERSION=...");
    let b = base();
    let image = etcd(pod_spec(&b.sts))
        .ok()
        .and_then(|c| c.image.clone())
        .unwrap_or_default();
    assert!(
        image.ends_with(&format!(":{version}")),
        "the StatefulSet runs {image}, the image carries etcd {version}: restore must use the same release"
    );

    // `cargo build --bins` compiles the library and every binary, so their directories must
    // reach the build stage. (The tests', benches' and examples' files need not: cargo reads
    // only the sources of the targets it builds, and the image builds none of those.)
    let cargo: toml::Table = read(&repo().join("Cargo.toml"))
        .parse()
        .expect("Cargo.toml");
    let mut paths = Vec::new();
    for section in ["bin"] {
        for t in cargo
            .get(section)
            .and_then(|v| v.as_array())
            .into_iter()
            .flatten()
        {
            paths.extend(t.get("path").and_then(|p| p.as_str()).map(str::to_string));
        }
    }
    paths.extend(
        get(&cargo, "lib.path")
            .and_then(|p| p.as_str())
            .map(str::to_string),
    );
    // etcd-druid runs the backup-restore image with its ENTRYPOINT /etcdbrctl and only args:
    // the `etcdbrctl` stage gives it, and the default image stays etcd-warden's own.
    let stages: Vec<&str> = containerfile.split("\nFROM ").skip(1).collect();
    let druid = stages
        .iter()
        .find(|s| {
            s.lines()
                .next()
                .is_some_and(|l| l.ends_with(" AS etcdbrctl"))
        })
        .expect("Containerfile: a stage `AS etcdbrctl` for etcd-druid");
    assert!(druid.contains("/etcdbrctl\n") && druid.contains("ENTRYPOINT [\"/etcdbrctl\"]"));
    let last = stages.last().expect("a final stage");
    assert!(
        last.starts_with("runtime"),
        "the default image is the runtime stage (ENTRYPOINT etcd-warden), not {last:?}"
    );
    for path in paths {
        let top = path.split('/').next().expect("component");
        assert!(
            containerfile
                .lines()
                .any(|l| l.trim().starts_with(&format!("COPY {top} "))),
            "Containerfile: Cargo.toml names {path}, but {top}/ is never copied into the build"
        );
    }
}

/// The etcd releases the image and the manifests run, as `(major.minor, tag)`; `problems` names
/// each way the pair is out of step: deploy/base on 3.5 (the image's default build argument the
/// same), deploy/components/etcd-3.6 a kustomize Component setting only etcd's image to a 3.6
/// tag, and the Containerfile's 3.6 build command naming that tag.
fn etcd_release_problems(
    containerfile: &str,
    base_image: &str,
    component: &serde_json::Value,
) -> Vec<String> {
    let mut problems = Vec::new();
    let default = containerfile
        .lines()
        .find_map(|l| l.trim().strip_prefix("ARG ETCD_VERSION="))
        .unwrap_or_default();
    if !default.starts_with("v3.5.") {
        problems.push(format!(
            "the image's default etcd is {default:?}, not a 3.5 release"
        ));
    }
    if base_image != format!("gcr.io/etcd-development/etcd:{default}") {
        problems.push(format!(
            "deploy/base runs {base_image}, the image carries {default}"
        ));
    }
    if component["kind"] != "Component" {
        problems.push("deploy/components/etcd-3.6 is not a kustomize Component".into());
    }
    let images = component["images"].as_array().cloned().unwrap_or_default();
    let tag = match images.as_slice() {
        [one] if one["name"] == "gcr.io/etcd-development/etcd" && one.get("newName").is_none() => {
            one["newTag"].as_str().unwrap_or_default().to_string()
        }
        _ => {
            problems.push(format!(
                "deploy/components/etcd-3.6 must set etcd's image tag and nothing else: {images:?}"
            ));
            String::new()
        }
    };
    if !tag.starts_with("v3.6.") {
        problems.push(format!(
            "deploy/components/etcd-3.6 runs etcd {tag:?}, not a 3.6 release"
        ));
    }
    if !containerfile.contains(&format!("--build-arg ETCD_VERSION={tag} ")) {
        problems.push(format!(
            "the Containerfile's 3.6 build does not say `--build-arg ETCD_VERSION={tag}`: restore \
             must run the cluster's release"
        ));
    }
    problems
}

#[test]
fn the_image_and_the_manifests_run_etcd_35_and_36_in_step() {
    let containerfile = read(&repo().join("Containerfile"));
    let b = base();
    let image = etcd(pod_spec(&b.sts))
        .ok()
        .and_then(|c| c.image.clone())
        .unwrap_or_default();
    let component = documents(&repo().join("deploy/components/etcd-3.6/kustomization.yaml"));
    let component = component.first().cloned().unwrap_or_default();
    let problems = etcd_release_problems(&containerfile, &image, &component);
    assert!(problems.is_empty(), "{problems:#?}");

    // Each way out of step is named.
    let tag = component["images"][0]["newTag"]
        .as_str()
        .unwrap()
        .to_string();
    let older = containerfile.replace(&format!("ETCD_VERSION={tag} "), "ETCD_VERSION=v3.6.0 ");
    let p = etcd_release_problems(&older, &image, &component);
    assert!(p.iter().any(|p| p.contains("3.6 build")), "{p:#?}");
    let p = etcd_release_problems(
        &containerfile,
        "gcr.io/etcd-development/etcd:v3.5.1",
        &component,
    );
    assert!(p.iter().any(|p| p.contains("deploy/base runs")), "{p:#?}");
    let mut on_35 = component.clone();
    on_35["images"][0]["newTag"] = "v3.5.33".into();
    let p = etcd_release_problems(&containerfile, &image, &on_35);
    assert!(p.iter().any(|p| p.contains("not a 3.6 release")), "{p:#?}");
    let mut renamed = component.clone();
    renamed["images"][0]["newName"] = "example.com/etcd".into();
    let p = etcd_release_problems(&containerfile, &image, &renamed);
    assert!(p.iter().any(|p| p.contains("nothing else")), "{p:#?}");
}

/// Every metric name `text` mentions (`etcd_warden_…`, `etcdbr_…`).
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in text.match_indices("etcd") {
        let rest = &text[i..];
        if !(rest.starts_with("etcd_warden_") || rest.starts_with("etcdbr_")) {
            continue;
        }
        if text[..i]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            continue;
        }
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        out.insert(rest[..end].to_string());
    }
    out
}

/// Every sample name `serve` exposes (a counter's `_total`, a histogram's `_bucket`, `_sum`,
/// `_count`), from the registry `sidecar::run` builds.
fn exported_metrics() -> BTreeSet<String> {
    // What the sidecar registers (sidecar::run registers exactly these).
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = etcd_warden::sidecar::SidecarMetrics {
        secondary: Some(Default::default()),
        kubernetes: Some(Default::default()),
        ..etcd_warden::sidecar::SidecarMetrics::new(true)
    };
    metrics.register(&mut registry);
    let owner = metrics.owner.as_ref().expect("ownership metrics");
    // Labelled counters appear only once a label value was used: use one of each.
    owner.record_check(&etcd_warden::owner::resolve::CheckResult::Owner, 0);
    owner.record_kill(&etcd_warden::kill::KillReport {
        processes: vec![(
            etcd_warden::kill::ProcessId {
                pid: 1,
                start_time: 1,
            },
            etcd_warden::kill::Outcome::Killed,
        )],
    });
    // Per-member gauges appear once a member was seen.
    metrics
        .snapshot
        .defrag_members_seen(&[etcd_warden::snapshot::defrag::MemberState {
            id: 1,
            client_urls: vec![],
            is_leader: true,
            is_learner: false,
            db_size: 1,
            db_size_in_use: 1,
            raft_index: 1,
            healthy: true,
        }]);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
    let mut exported = BTreeSet::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut parts = rest.split_whitespace();
        let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
            continue;
        };
        let samples: &[&str] = match kind {
            "counter" => &["_total"],
            "histogram" => &["_bucket", "_sum", "_count"],
            _ => &[""],
        };
        exported.extend(samples.iter().map(|s| format!("{name}{s}")));
    }
    exported
}

/// PromQL's keywords and aggregation operators: words that are never a metric name.
const PROMQL_WORDS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "group",
    "inf",
    "nan",
];

/// The metric names in a PromQL expression (or a Grafana query): every identifier that is not a
/// function (followed by `(`), a keyword, a label in a selector `{…}` or a grouping `by (…)`, a
/// string, a number or a range `[…]`, so a metric of another exporter cannot slip in unchecked.
fn promql_metrics(expr: &str) -> BTreeSet<String> {
    let chars: Vec<char> = expr.chars().collect();
    // The index just past the string starting at `i` (its quote).
    let skip_string = |mut i: usize| {
        let quote = chars[i];
        i += 1;
        while i < chars.len() && chars[i] != quote {
            i += if chars[i] == '\\' { 2 } else { 1 };
        }
        i + 1
    };
    let mut out = BTreeSet::new();
    let mut i = 0;
    // Set after `by`, `on`, …: the next parenthesis holds label names.
    let mut labels_follow = false;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => i = skip_string(i),
            // Label matchers and ranges hold no metric names.
            '{' | '[' => {
                let close = if c == '{' { '}' } else { ']' };
                while i < chars.len() && chars[i] != close {
                    i = if chars[i] == '"' {
                        skip_string(i)
                    } else {
                        i + 1
                    };
                }
                i += 1;
            }
            '(' if labels_follow => {
                while i < chars.len() && chars[i] != ')' {
                    i += 1;
                }
                labels_follow = false;
                i += 1;
            }
            // Grafana's variables: `$__rate_interval`, `$namespace`.
            '$' => {
                i += 1;
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
            }
            // A number or a duration: 1e9, 0.99, 5m.
            c if c.is_ascii_digit() || c == '.' => {
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                    i += 1;
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let lower = word.to_ascii_lowercase();
                let next = chars[i..].iter().find(|c| !c.is_whitespace());
                if [
                    "by",
                    "without",
                    "on",
                    "ignoring",
                    "group_left",
                    "group_right",
                ]
                .contains(&lower.as_str())
                {
                    labels_follow = true;
                } else if !(PROMQL_WORDS.contains(&lower.as_str()) || next == Some(&'(')) {
                    out.insert(word);
                }
            }
            _ => i += 1,
        }
    }
    out
}

/// Every `"expr"` string in a JSON document (a Grafana dashboard's targets), wherever it is.
fn json_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(o) => {
            for (k, v) in o {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(e)) => out.push(e.clone()),
                    _ => json_exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| json_exprs(v, out)),
        _ => {}
    }
}

/// The ```yaml block of the docs/operations.md section headed `heading`, as JSON.
fn documented_yaml(heading: &str) -> serde_json::Value {
    let doc = read(&repo().join("docs/operations.md"));
    let section = doc
        .split(&format!("\n{heading}\n"))
        .nth(1)
        .unwrap_or_else(|| panic!("docs/operations.md: no {heading}"));
    let yaml = section
        .split("```yaml")
        .nth(1)
        .and_then(|s| s.split("```").next())
        .unwrap_or_else(|| panic!("docs/operations.md: no ```yaml block under {heading}"));
    serde_json::to_value(serde_yaml::from_str::<serde_yaml::Value>(yaml).expect("alert YAML"))
        .expect("JSON")
}

/// The rule groups docs/operations.md documents: the sidecar's ("Alert rules") then etcd's
/// ("Alerts for etcd itself").
fn documented_rule_groups() -> Vec<serde_json::Value> {
    ["## Alert rules (Prometheus)", "## Alerts for etcd itself"]
        .into_iter()
        .flat_map(|h| {
            documented_yaml(h)["groups"]
                .as_array()
                .cloned()
                .unwrap_or_else(|| panic!("docs/operations.md: {h}: no groups"))
        })
        .collect()
}

/// Every sample name one etcd release exposes on `/metrics`, from a real two-member cluster
/// that has served a gRPC request (`grpc_server_…`), refused a learner's promotion
/// (`etcd_server_learner_promote_failures`) and probed its peer (the round-trip histogram, first
/// observed some 5 s after the peers connect): labelled families appear only once used.
async fn etcd_metrics(release: support::etcd::Release) -> BTreeSet<String> {
    use etcd_client::MemberAddOptions;
    use std::time::{Duration, Instant};

    let cluster = support::etcd::EtcdCluster::start(2, release).await;
    let mut client = cluster.client().await;
    client.put("alerts", "v", None).await.expect("put");
    // A learner that never starts is never in sync, so its promotion is refused. etcd refuses
    // membership changes for a few seconds after the cluster starts.
    let peer = format!("http://127.0.0.1:{}", support::free_port());
    let deadline = Instant::now() + Duration::from_secs(30);
    let learner = loop {
        let add = MemberAddOptions::new().with_is_learner();
        match client.member_add([peer.as_str()], Some(add)).await {
            Ok(r) => break r.member().map(|m| m.id()).expect("the added learner"),
            Err(e) if Instant::now() > deadline => panic!("etcd {release:?}: member add: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    client
        .member_promote(learner)
        .await
        .expect_err("a learner that never started was promoted");
    let wanted = [
        "grpc_server_handled_total",
        "etcd_server_learner_promote_failures",
        "etcd_network_peer_round_trip_time_seconds_bucket",
    ];
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut names = BTreeSet::new();
        for m in &cluster.members {
            let url = format!("{}/metrics", m.client_url());
            let text = match reqwest::get(&url).await.and_then(|r| r.error_for_status()) {
                Ok(r) => r.text().await,
                Err(e) => Err(e),
            };
            let text = text.unwrap_or_else(|e| panic!("GET {url}: {e}"));
            names.extend(
                text.lines()
                    .filter(|l| !l.starts_with('#'))
                    .filter_map(|l| l.split(['{', ' ']).next())
                    .filter(|n| !n.is_empty())
                    .map(str::to_string),
            );
        }
        let missing: Vec<&str> = wanted.into_iter().filter(|w| !names.contains(*w)).collect();
        if missing.is_empty() {
            return names;
        }
        assert!(
            Instant::now() < deadline,
            "etcd {release:?} does not expose {missing:?} after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// What the monitoring manifests may use: what `serve` exposes, and what etcd 3.4 and 3.5 both
/// expose (a rule on a metric one release lacks would never fire there).
async fn monitorable_metrics() -> BTreeSet<String> {
    use support::etcd::Release;
    let (v34, v35) = tokio::join!(etcd_metrics(Release::V34), etcd_metrics(Release::V35));
    let mut out = exported_metrics();
    out.extend(v34.intersection(&v35).cloned());
    out
}

#[tokio::test]
async fn the_monitoring_manifests_use_only_exposed_metrics() {
    let exported = monitorable_metrics().await;
    let dir = repo().join("deploy/monitoring");
    let k = kustomization(&dir).unwrap_or_else(|e| panic!("{e}"));

    // The PrometheusRule is the documented rules, exactly.
    let rules: Vec<&PrometheusRule> = k
        .objects
        .iter()
        .filter_map(|o| match o {
            Object::PrometheusRule(r) => Some(r.as_ref()),
            _ => None,
        })
        .collect();
    let [rule] = rules.as_slice() else {
        panic!(
            "deploy/monitoring: expected one PrometheusRule, found {}",
            rules.len()
        );
    };
    let documented = serde_json::Value::Array(documented_rule_groups());
    let deployed = serde_json::to_value(&rule.spec).expect("JSON");
    assert_eq!(
        deployed["groups"], documented,
        "deploy/monitoring/prometheusrule.yaml differs from docs/operations.md's alert rules \
         (\"Alert rules\" and \"Alerts for etcd itself\")"
    );

    // The dashboard: shipped by the kustomization, and every query on an exposed metric.
    let dashboards = &k.config_maps["etcd-warden-dashboard"];
    let text = &dashboards["etcd-warden-dashboard.json"];
    let dashboard: serde_json::Value = serde_json::from_str(text).expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    json_exprs(&dashboard, &mut exprs);
    for expr in rule
        .spec
        .groups
        .iter()
        .flat_map(|g| &g.rules)
        .map(|r| &r.expr)
        .chain(&exprs)
    {
        let names = promql_metrics(expr);
        assert!(!names.is_empty(), "a query without a metric: {expr}");
        for name in names {
            assert!(
                exported.contains(&name),
                "{expr:?} uses {name}, which neither serve nor etcd 3.4 and 3.5 expose"
            );
        }
    }
    // What the dashboard is for: snapshot age, size and duration, delta lag, ownership state
    // and kills, restore durations; etcd's leader changes, proposal rates, fsync and commit
    // latencies, database size against its quota and fragmentation.
    let used: BTreeSet<String> = exprs.iter().flat_map(|e| promql_metrics(e)).collect();
    for needed in [
        "etcdbr_snapshot_latest_timestamp",
        "etcd_warden_snapshot_latest_size_bytes",
        "etcdbr_snapshot_duration_seconds_bucket",
        "etcdbr_snapstore_latest_deltas_revisions_total",
        "etcd_warden_owner_state",
        "etcd_warden_owner_kills_total",
        "etcdbr_restoration_duration_seconds_sum",
        "etcd_server_leader_changes_seen_total",
        "etcd_server_proposals_committed_total",
        "etcd_server_proposals_failed_total",
        "etcd_disk_wal_fsync_duration_seconds_bucket",
        "etcd_disk_backend_commit_duration_seconds_bucket",
        "etcd_mvcc_db_total_size_in_bytes",
        "etcd_mvcc_db_total_size_in_use_in_bytes",
        "etcd_server_quota_backend_bytes",
    ] {
        assert!(used.contains(needed), "the dashboard shows no {needed}");
    }
}

#[test]
fn a_query_on_a_metric_serve_does_not_expose_is_caught() {
    let exported = exported_metrics();
    for expr in [
        "etcd_mvcc_db_total_size_in_bytes{job=\"etcd\"}",
        "rate(etcdbr_add_learner_duration_seconds_count[5m])",
        "etcd_warden_snapshot_latest_size{kind=\"Full\"}",
    ] {
        let names = promql_metrics(expr);
        assert!(
            names.iter().any(|n| !exported.contains(n)),
            "{expr}: {names:?} all exposed?"
        );
    }
    assert_eq!(
        promql_metrics(
            "histogram_quantile(0.9, sum by (le) (rate(etcdbr_snapshot_duration_seconds_bucket{kind=\"Full\"}[5m])))"
        ),
        BTreeSet::from(["etcdbr_snapshot_duration_seconds_bucket".to_string()])
    );
    // Bare names count, labels, functions, keywords, numbers and Grafana's variables do not.
    let names = |e: &str| promql_metrics(e).into_iter().collect::<Vec<_>>();
    assert_eq!(
        names("etcd_server_has_leader == 0"),
        ["etcd_server_has_leader"]
    );
    assert_eq!(
        names(
            "sum without (grpc_type, grpc_code) (rate(grpc_server_handled_total{grpc_code=~\"Unknown|Internal\"}[5m])) / on (pod) group_left sum by (pod) (rate(grpc_server_handled_total[$__rate_interval])) > 1e-2 unless up offset 5m"
        ),
        ["grpc_server_handled_total", "up"]
    );
    assert_eq!(
        names(
            "predict_linear(etcd_mvcc_db_total_size_in_bytes[4h], 4 * 3600) > bool etcd_server_quota_backend_bytes"
        ),
        [
            "etcd_mvcc_db_total_size_in_bytes",
            "etcd_server_quota_backend_bytes"
        ]
    );
}

#[test]
fn every_metric_in_the_alert_rules_is_exported() {
    let doc = read(&repo().join("docs/operations.md"));
    let section = doc
        .split("## Alert rules")
        .nth(1)
        .expect("docs/operations.md: ## Alert rules");
    let yaml = section
        .split("```yaml")
        .nth(1)
        .and_then(|s| s.split("```").next())
        .expect("a ```yaml block of alert rules");
    let rules: serde_json::Value =
        serde_json::to_value(serde_yaml::from_str::<serde_yaml::Value>(yaml).expect("alert YAML"))
            .expect("JSON");
    let exprs: Vec<String> = rules["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .map(|r| {
            r["expr"]
                .as_str()
                .expect("every rule has an expr")
                .to_string()
        })
        .collect();
    assert!(exprs.len() >= 3, "too few alert rules: {exprs:?}");

    let exported = exported_metrics();
    for expr in &exprs {
        let names = metric_names(expr);
        assert!(
            !names.is_empty(),
            "alert expr uses no etcd-warden metric: {expr}"
        );
        for name in names {
            assert!(
                exported.contains(&name),
                "alert expr {expr:?} uses {name}, which the sidecar does not export; exported: {exported:?}"
            );
        }
    }
    // The metrics table names real metrics too.
    let table = doc
        .split("## Metrics")
        .nth(1)
        .and_then(|s| s.split("## ").next())
        .expect("## Metrics");
    for name in metric_names(table) {
        let found = exported.contains(&name) || exported.iter().any(|e| e.starts_with(&name));
        assert!(
            found,
            "docs/operations.md lists {name}, which is not exported; exported: {exported:?}"
        );
    }
}

/// Everything wrong with the compaction CronJob: one `compact` at a time, its work directory on
/// a size-limited emptyDir, the store's credentials from the etcd-backup Secret, a configuration
/// the binary accepts, and the pod's hardening.
/// A CronJob of `etcd-warden <command>` (`compact`, `verify --restore`): one at a time, one
/// container running the command, a sized emptyDir as its work directory, its configuration
/// mounted and accepted, the bucket's credentials from the Secret, and the restricted security
/// settings.
fn job_cronjob_problems(
    cron: &CronJob,
    command: &[&str],
    config_maps: &BTreeMap<String, BTreeMap<String, String>>,
    secrets: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<String> {
    let mut out = Vec::new();
    let Some(spec) = cron.spec.as_ref() else {
        return vec!["CronJob has no spec".into()];
    };
    if spec.concurrency_policy.as_deref() != Some("Forbid") {
        out.push("two at once would restore (and for compact, store) the same chain twice: concurrencyPolicy must be Forbid".into());
    }
    let Some(pod) = spec
        .job_template
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
    else {
        return vec!["CronJob has no pod spec".into()];
    };
    let [c] = pod.containers.as_slice() else {
        return vec!["the Job has exactly one container".into()];
    };
    let line = command_line(c);
    if !line.starts_with(&command.iter().map(|s| s.to_string()).collect::<Vec<_>>()) {
        out.push(format!("the CronJob runs {line:?}, not {command:?}"));
    }
    match arg_after(&line, "--work-dir") {
        None => out.push("no --work-dir: the temporary etcd would fill the node's /tmp".into()),
        Some(dir) => {
            let mount = c
                .volume_mounts
                .iter()
                .flatten()
                .find(|m| m.mount_path == dir);
            let sized = mount
                .and_then(|m| volume(pod, &m.name))
                .and_then(|v| v.empty_dir.as_ref())
                .is_some_and(|e| e.size_limit.is_some());
            if !sized {
                out.push(format!(
                    "--work-dir {dir} is not an emptyDir with a sizeLimit (it holds about twice the database)"
                ));
            }
        }
    }
    match mounted_toml(pod, c, config_maps, "the Job's") {
        Err(e) => out.push(e),
        Ok((text, raw)) => {
            let files = file_keys(&raw);
            out.extend(section_secret_problems(
                pod,
                c,
                &files,
                "store",
                "etcd-backup",
                secrets,
            ));
            out.extend(subcommand_config_problem(c, &text));
        }
    }
    out.extend(security_problems(pod, c, &[]));
    out
}

/// deploy/compact-job and deploy/drill-job: each one CronJob that passes
/// [`job_cronjob_problems`], and fails it when run in parallel or with an unbounded work
/// directory.
#[test]
fn the_compact_and_drill_cronjobs_run_one_at_a_time_with_room_to_work() {
    for (dir, command) in [
        ("deploy/compact-job", &["compact"][..]),
        ("deploy/drill-job", &["verify", "--restore"][..]),
    ] {
        let k = kustomization(&repo().join(dir)).unwrap_or_else(|e| panic!("{e}"));
        let crons: Vec<CronJob> = k
            .objects
            .into_iter()
            .map(|o| match o {
                Object::CronJob(j) => *j,
                other => panic!("{dir}: unexpected {other:?}"),
            })
            .collect();
        let [cron] = <[CronJob; 1]>::try_from(crons).expect("one CronJob");
        let secrets = example_secrets();
        let problems =
            |cron: &CronJob| job_cronjob_problems(cron, command, &k.config_maps, &secrets);
        assert!(problems(&cron).is_empty(), "{dir}: {:#?}", problems(&cron));

        let mut parallel = cron.clone();
        parallel.spec.as_mut().expect("spec").concurrency_policy = Some("Allow".into());
        assert!(
            problems(&parallel).iter().any(|p| p.contains("Forbid")),
            "{dir}: {:#?}",
            problems(&parallel)
        );

        let mut unbounded = cron.clone();
        for v in unbounded
            .spec
            .as_mut()
            .and_then(|s| s.job_template.spec.as_mut())
            .and_then(|s| s.template.spec.as_mut())
            .and_then(|p| p.volumes.as_mut())
            .expect("volumes")
        {
            if let Some(e) = v.empty_dir.as_mut() {
                e.size_limit = None;
            }
        }
        assert!(
            problems(&unbounded).iter().any(|p| p.contains("sizeLimit")),
            "{dir}: {:#?}",
            problems(&unbounded)
        );
    }
}

/// deploy/operator, typed.
struct OperatorDeploy {
    deployment: Deployment,
    service_accounts: Vec<ServiceAccount>,
    roles: Vec<Role>,
    bindings: Vec<RoleBinding>,
    cluster_roles: Vec<ClusterRole>,
    cluster_bindings: Vec<ClusterRoleBinding>,
    crds: Vec<CustomResourceDefinition>,
    config_maps: BTreeMap<String, BTreeMap<String, String>>,
}

fn operator_deploy() -> OperatorDeploy {
    let k = kustomization(&repo().join("deploy/operator")).unwrap_or_else(|e| panic!("{e}"));
    let mut deployments = Vec::new();
    let mut d = OperatorDeploy {
        deployment: Deployment::default(),
        service_accounts: Vec::new(),
        roles: Vec::new(),
        bindings: Vec::new(),
        cluster_roles: Vec::new(),
        cluster_bindings: Vec::new(),
        crds: Vec::new(),
        config_maps: k.config_maps,
    };
    for o in k.objects {
        match o {
            Object::Deployment(x) => deployments.push(*x),
            Object::ServiceAccount(x) => d.service_accounts.push(*x),
            Object::Role(x) => d.roles.push(*x),
            Object::RoleBinding(x) => d.bindings.push(*x),
            Object::ClusterRole(x) => d.cluster_roles.push(*x),
            Object::ClusterRoleBinding(x) => d.cluster_bindings.push(*x),
            Object::CustomResourceDefinition(x) => d.crds.push(*x),
            other => panic!("deploy/operator: unexpected {other:?}"),
        }
    }
    let [deployment] = <[Deployment; 1]>::try_from(deployments).expect("one Deployment");
    d.deployment = deployment;
    d
}

/// What is wrong with the operator's RBAC: a wildcard, a Secret readable, a verb the operator
/// never sends, a binding to anyone but the Deployment's service account, a cluster-wide right
/// beyond listing Nodes.
fn operator_rbac_problems(d: &OperatorDeploy, sa: (&str, &str)) -> Vec<String> {
    let mut out = Vec::new();
    for r in &d.cluster_roles {
        for rule in r.rules.iter().flatten() {
            let nodes_only = rule.api_groups.as_deref() == Some(&[String::new()][..])
                && rule.resources.as_deref() == Some(&["nodes".to_string()][..])
                && rule.verbs == ["list"];
            if !nodes_only {
                out.push(format!(
                    "ClusterRole {:?}: cluster-wide {rule:?} (only listing Nodes is needed)",
                    r.metadata.name
                ));
            }
        }
    }
    for b in &d.cluster_bindings {
        for s in b.subjects.iter().flatten() {
            if (s.kind.as_str(), s.namespace.as_deref(), s.name.as_str())
                != ("ServiceAccount", Some(sa.0), sa.1)
            {
                out.push(format!(
                    "ClusterRoleBinding {:?} binds {s:?}",
                    b.metadata.name.as_deref()
                ));
            }
        }
    }
    for r in &d.roles {
        let name = r.metadata.name.clone().unwrap_or_default();
        for rule in r.rules.iter().flatten() {
            let lists = [
                rule.api_groups.clone().unwrap_or_default(),
                rule.resources.clone().unwrap_or_default(),
                rule.verbs.clone(),
            ];
            if lists.iter().flatten().any(|x| x == "*") {
                out.push(format!("Role {name}: a wildcard in {rule:?}"));
            }
            if rule.resources.iter().flatten().any(|x| x == "secrets") {
                out.push(format!(
                    "Role {name}: Secrets are not the operator's business"
                ));
            }
            for v in &rule.verbs {
                if !["get", "list", "watch", "create", "patch", "delete"].contains(&v.as_str()) {
                    out.push(format!("Role {name}: verb {v} is never sent"));
                }
            }
        }
    }
    for b in &d.bindings {
        for s in b.subjects.iter().flatten() {
            if (s.kind.as_str(), s.namespace.as_deref(), s.name.as_str())
                != ("ServiceAccount", Some(sa.0), sa.1)
            {
                out.push(format!(
                    "RoleBinding {:?} binds {s:?}",
                    b.metadata.name.as_deref()
                ));
            }
        }
        if !d.roles.iter().any(|r| {
            r.metadata.name.as_deref() == Some(&b.role_ref.name)
                && r.metadata.namespace == b.metadata.namespace
        }) {
            out.push(format!(
                "RoleBinding {:?} names a Role not in deploy/operator",
                b.metadata.name
            ));
        }
    }
    out
}

#[test]
fn the_operator_crds_are_what_crdgen_generates() {
    let committed = read(&repo().join("deploy/operator/crds.yaml"));
    let generated = etcd_warden::operator::crd::yaml().expect("generate");
    assert!(
        committed == generated,
        "deploy/operator/crds.yaml differs from the generated CRDs; run \
         `cargo run --bin etcd-warden-operator crdgen > deploy/operator/crds.yaml`"
    );
    let d = operator_deploy();
    let mut names: Vec<String> = d
        .crds
        .iter()
        .filter_map(|c| c.metadata.name.clone())
        .collect();
    names.sort();
    let mut want: Vec<String> = etcd_warden::operator::crd::definitions()
        .into_iter()
        .filter_map(|c| c.metadata.name)
        .collect();
    want.sort();
    assert_eq!(names, want, "the kustomization installs every CRD");
}

/// The fields each CEL rule reaches: `self` / `oldSelf` followed by `.field` steps, up to the
/// first method call or index (`self.a.b.all(...)`, `self.a[k]` reach `a.b`, `a`).
fn rule_paths(rule: &str) -> Vec<Vec<String>> {
    let bytes = rule.as_bytes();
    let ident = |i: usize| -> usize {
        let mut j = i;
        while j < bytes.len() && (bytes[j].is_ascii_alphanumeric() || bytes[j] == b'_') {
            j += 1;
        }
        j
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let word_start = i == 0
            || !(bytes[i - 1].is_ascii_alphanumeric()
                || bytes[i - 1] == b'_'
                || bytes[i - 1] == b'.');
        let end = ident(i);
        if end == i {
            i += 1;
            continue;
        }
        if word_start && matches!(&rule[i..end], "self" | "oldSelf") {
            let mut path = Vec::new();
            let mut j = end;
            while j < bytes.len() && bytes[j] == b'.' {
                let k = ident(j + 1);
                if k == j + 1 || bytes.get(k) == Some(&b'(') {
                    break;
                }
                path.push(rule[j + 1..k].to_owned());
                j = k;
            }
            out.push(path);
            i = j;
        } else {
            i = end;
        }
    }
    out
}

/// Where `node`'s subtree has a list without `maxItems`, a map without `maxProperties`, a
/// string without `maxLength` (an enum or a date/duration format bounds it, as the API server's
/// cost estimate counts them), or free-form content.
fn unbounded(at: &str, node: &serde_json::Value, out: &mut Vec<String>) {
    if node["x-kubernetes-preserve-unknown-fields"] == true && node.get("properties").is_none() {
        out.push(format!("{at}: free-form"));
        return;
    }
    match node["type"].as_str() {
        Some("array") => {
            if node.get("maxItems").is_none() {
                out.push(format!("{at}: a list without maxItems"));
            }
            unbounded(&format!("{at}[]"), &node["items"], out);
        }
        Some("string") => {
            let bounded_format = matches!(
                node["format"].as_str(),
                Some("date" | "date-time" | "duration")
            );
            if node.get("maxLength").is_none() && node.get("enum").is_none() && !bounded_format {
                out.push(format!("{at}: a string without maxLength"));
            }
        }
        Some("object") => {
            if let Some(values) = node.get("additionalProperties").filter(|v| v.is_object()) {
                if node.get("maxProperties").is_none() {
                    out.push(format!("{at}: a map without maxProperties"));
                }
                unbounded(&format!("{at}{{}}"), values, out);
            }
            for (name, p) in node["properties"].as_object().into_iter().flatten() {
                unbounded(&format!("{at}.{name}"), p, out);
            }
        }
        _ => {}
    }
}

/// Every CEL rule of `schema` (an `openAPIV3Schema`) that reaches an unbounded list, map or
/// string, as `path: rule: what`.
fn unbounded_rule_fields(schema: &serde_json::Value) -> Vec<String> {
    fn walk(at: &str, node: &serde_json::Value, root: bool, out: &mut Vec<String>) {
        for v in node["x-kubernetes-validations"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let rule = v["rule"].as_str().unwrap_or_default();
            for path in rule_paths(rule) {
                let mut reached = node;
                let mut name = at.to_owned();
                let mut steps = path.iter();
                // The object's own metadata: only name and generateName, which the API server
                // validates (253 characters) before any rule runs.
                if root && path.first().map(String::as_str) == Some("metadata") {
                    continue;
                }
                for step in steps.by_ref() {
                    match reached["properties"].get(step) {
                        Some(p) => {
                            reached = p;
                            name = format!("{name}.{step}");
                        }
                        // A map key or an unknown field: the whole node is reached.
                        None => break,
                    }
                }
                let mut problems = Vec::new();
                unbounded(&name, reached, &mut problems);
                for p in problems {
                    out.push(format!("{at}: {rule}: {p}"));
                }
            }
        }
        for (k, p) in node["properties"].as_object().into_iter().flatten() {
            walk(&format!("{at}.{k}"), p, false, out);
        }
        if let Some(items) = node.get("items") {
            walk(&format!("{at}[]"), items, false, out);
        }
        if let Some(values) = node.get("additionalProperties").filter(|v| v.is_object()) {
            walk(&format!("{at}{{}}"), values, false, out);
        }
    }
    let mut out = Vec::new();
    walk("", schema, true, &mut out);
    out.sort();
    out.dedup();
    out
}

/// Every CRD in deploy/operator/crds.yaml as JSON.
fn operator_crd_schemas() -> Vec<(String, serde_json::Value)> {
    documents(&repo().join("deploy/operator/crds.yaml"))
        .into_iter()
        .flat_map(|crd| {
            let name = crd["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            crd["spec"]["versions"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .map(move |v| {
                    (
                        format!("{name} {}", v["name"].as_str().unwrap_or_default()),
                        v["schema"]["openAPIV3Schema"].clone(),
                    )
                })
        })
        .collect()
}

/// A real API server refuses a CRD whose CEL rules' estimated cost is over budget, and an
/// unbounded list, map or string a rule reaches is what puts it there (issue 29: the selector
/// rule over unbounded label maps was refused at more than 100x the budget).
#[test]
fn every_field_a_cel_rule_reaches_is_bounded() {
    let schemas = operator_crd_schemas();
    let rules: usize = schemas
        .iter()
        .map(|(_, s)| s.to_string().matches("\"rule\"").count())
        .sum();
    assert!(rules >= 4, "the CRDs carry their CEL rules ({rules})");
    let problems: Vec<String> = schemas
        .iter()
        .flat_map(|(name, s)| {
            unbounded_rule_fields(s)
                .into_iter()
                .map(move |p| format!("{name}{p}"))
        })
        .collect();
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn a_cel_rule_over_an_unbounded_field_is_caught() {
    assert_eq!(
        rule_paths(
            "!has(self.selector.matchLabels) || self.selector.matchLabels.all(k, self.t.labels[k] == oldSelf.x)"
        ),
        [
            vec!["selector".to_owned(), "matchLabels".to_owned()],
            vec!["selector".to_owned(), "matchLabels".to_owned()],
            vec!["t".to_owned(), "labels".to_owned()],
            vec!["x".to_owned()],
        ]
    );
    let (_, mut schema) = operator_crd_schemas()
        .into_iter()
        .find(|(n, _)| n.starts_with("controlplanesets."))
        .expect("the ControlPlaneSet CRD");
    let spec = &mut schema["properties"]["spec"]["properties"];
    spec["selector"]["properties"]["matchLabels"]
        .as_object_mut()
        .expect("matchLabels")
        .remove("maxProperties");
    spec["template"]["properties"]["metadata"]["properties"]["labels"]["additionalProperties"]
        .as_object_mut()
        .expect("label values")
        .remove("maxLength");
    spec["selector"]["properties"]["matchExpressions"]["items"]["properties"]["values"]
        .as_object_mut()
        .expect("values")
        .remove("maxItems");
    let problems = unbounded_rule_fields(&schema).join("\n");
    for want in [
        ".spec.selector.matchLabels: a map without maxProperties",
        ".spec.template.metadata.labels{}: a string without maxLength",
        ".spec.selector.matchExpressions[].values: a list without maxItems",
    ] {
        assert!(problems.contains(want), "{want} not in\n{problems}");
    }
}

#[test]
fn the_operator_deployment_runs_leader_elected_replicas_with_least_privilege() {
    let d = operator_deploy();
    let dep = &d.deployment;
    let ns = dep.metadata.namespace.clone().expect("a namespace");
    let spec = dep.spec.as_ref().expect("spec");
    assert_eq!(
        spec.replicas,
        Some(2),
        "two replicas, one acting (the Lease)"
    );
    let pod = spec.template.spec.as_ref().expect("pod spec");
    let sa = pod
        .service_account_name
        .clone()
        .expect("its own service account");
    assert!(
        d.service_accounts.iter().any(|s| {
            s.metadata.name.as_deref() == Some(&sa) && s.metadata.namespace.as_deref() == Some(&ns)
        }),
        "ServiceAccount {ns}/{sa} is in deploy/operator"
    );
    let problems = operator_rbac_problems(&d, (&ns, &sa));
    assert!(problems.is_empty(), "{problems:#?}");
    // Bound in both namespaces it works in.
    let mut bound: Vec<String> = d
        .bindings
        .iter()
        .filter_map(|b| b.metadata.namespace.clone())
        .collect();
    bound.sort();
    assert_eq!(bound, ["openshift-etcd", "openshift-machine-api"]);

    let [c] = pod.containers.as_slice() else {
        panic!("one container");
    };
    assert_eq!(command_line(c).get(1).map(String::as_str), Some("kube"));
    let env = c.env.iter().flatten().find(|e| e.name == "POD_NAME");
    let field = env
        .and_then(|e| e.value_from.as_ref())
        .and_then(|v| v.field_ref.as_ref())
        .map(|f| f.field_path.as_str());
    assert_eq!(
        field,
        Some("metadata.name"),
        "the Lease identity is the pod's name"
    );
    let sec = security_problems(pod, c, &[]);
    assert!(sec.is_empty(), "{sec:#?}");
    let spread = pod
        .affinity
        .as_ref()
        .and_then(|a| a.pod_anti_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .is_some_and(|t| t.iter().any(|t| t.topology_key == "kubernetes.io/hostname"));
    assert!(spread, "the replicas run on different nodes");

    // The mounted configuration is what the real loader accepts, its certificate files are on
    // the Secret's mount, and the probes and the port are where it listens.
    let (_, text) = mounted_config(pod, c, &d.config_maps).unwrap_or_else(|e| panic!("{e}"));
    let table: toml::Table = text.parse().expect("operator.toml is TOML");
    let secret_mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| {
            volume(pod, &m.name).is_some_and(|v| {
                v.secret.as_ref().and_then(|s| s.secret_name.as_deref())
                    == Some("etcd-warden-operator-etcd-client")
            })
        })
        .map(|m| m.mount_path.clone())
        .expect("the etcd client certificate Secret is mounted");
    let tmp = tempfile::tempdir().expect("temp dir");
    let mut local = text.clone();
    for key in ["etcd_ca_file", "etcd_cert_file", "etcd_key_file"] {
        let path = table[key]
            .as_str()
            .unwrap_or_else(|| panic!("{key} is set"));
        assert!(
            Path::new(path).starts_with(&secret_mount),
            "{key} = {path} is not on the Secret's mount {secret_mount}"
        );
        let copy = tmp.path().join(file_name(path));
        std::fs::write(&copy, "pem").expect("write");
        local = local.replace(path, &copy.display().to_string());
    }
    let file = tmp.path().join("operator.toml");
    std::fs::write(&file, local).expect("write");
    let loaded = etcd_warden::operator::kube::config::KubeConfig::load(
        &Sources {
            file: Some(&file),
            env: &HashMap::from([("POD_NAME".to_string(), "etcd-warden-operator-0".to_string())]),
            overrides: Vec::new(),
        },
        None,
    )
    .unwrap_or_else(|e| panic!("deploy/operator/operator.toml: {e}"));
    assert_eq!(loaded.settings.identity, "etcd-warden-operator-0");
    assert_eq!(
        loaded.settings.lease_name, "etcd-warden-operator",
        "the Lease the Role names"
    );
    let port = i32::from(loaded.listen.port());
    for (what, probe) in [
        ("liveness", c.liveness_probe.as_ref()),
        ("readiness", c.readiness_probe.as_ref()),
    ] {
        let get = probe
            .and_then(|p| p.http_get.as_ref())
            .unwrap_or_else(|| panic!("a {what} probe over HTTP"));
        assert_eq!(
            resolve_port(pod, &get.port),
            Some(port),
            "{what} probe port"
        );
        let want = if what == "liveness" {
            "/healthz"
        } else {
            "/readyz"
        };
        assert_eq!(get.path.as_deref(), Some(want), "{what} probe path");
    }
}

#[test]
fn a_wildcard_or_a_foreign_binding_in_the_operator_rbac_is_refused() {
    let mut d = operator_deploy();
    let (ns, sa) = ("openshift-etcd", "etcd-warden-operator");
    assert!(operator_rbac_problems(&d, (ns, sa)).is_empty());
    d.roles[0].rules.as_mut().unwrap()[0].verbs.push("*".into());
    d.bindings[0].subjects.as_mut().unwrap()[0].name = "default".into();
    d.cluster_roles[0].rules.as_mut().unwrap()[0]
        .verbs
        .push("watch".into());
    let problems = operator_rbac_problems(&d, (ns, sa)).join("\n");
    assert!(problems.contains("cluster-wide"), "{problems}");
    assert!(problems.contains("wildcard"), "{problems}");
    assert!(problems.contains("\"default\""), "{problems}");
}

/// The example set is one the controller accepts (its own checks, the ones CEL makes on a real
/// API server), for AWS: the zone goes where AWS Machines carry it.
#[test]
fn the_example_control_plane_set_is_accepted_and_aws_shaped() {
    use etcd_warden::operator::control_plane_set::resource::validate;
    let path = repo().join("deploy/operator/examples/controlplaneset-aws.yaml");
    let [doc] = <[serde_json::Value; 1]>::try_from(documents(&path)).expect("one document");
    let Object::ControlPlaneSet(_) = typed(&doc).unwrap_or_else(|e| panic!("{e}")) else {
        panic!("a ControlPlaneSet");
    };
    validate(&doc, None).unwrap_or_else(|e| panic!("{}: refused: {e:?}", path.display()));
    assert_eq!(doc["spec"]["failureDomains"]["platform"], "AWS");
    let provider = &doc["spec"]["template"]["spec"]["providerSpec"]["value"];
    assert_eq!(provider["kind"], "AWSMachineProviderConfig");
    assert!(
        provider["placement"]["availabilityZone"].is_null(),
        "the set injects the zone"
    );
    // The operator's configuration orders membership changes for this strategy.
    let config: toml::Table = read(&repo().join("deploy/operator/operator.toml"))
        .parse()
        .expect("TOML");
    assert_eq!(
        config["set_strategy"].as_str(),
        doc["spec"]["strategy"]["type"].as_str()
    );
    // A broken copy is refused naming the field.
    let mut bad = doc.clone();
    bad["spec"]["replicas"] = serde_json::json!(4);
    let e = format!("{:?}", validate(&bad, None).expect_err("replicas 4"));
    assert!(e.contains("spec.replicas"), "{e}");
}

/// deploy/kubeadm, typed: the DaemonSet, the drill CronJob it brings along, the ConfigMaps.
#[derive(Clone)]
struct KubeadmDeploy {
    daemonset: DaemonSet,
    drill: CronJob,
    config_maps: BTreeMap<String, BTreeMap<String, String>>,
}

fn kubeadm_deploy() -> KubeadmDeploy {
    let k = kustomization(&repo().join("deploy/kubeadm")).unwrap_or_else(|e| panic!("{e}"));
    let (mut daemonsets, mut crons) = (Vec::new(), Vec::new());
    for o in k.objects {
        match o {
            Object::DaemonSet(d) => daemonsets.push(*d),
            Object::CronJob(c) => crons.push(*c),
            other => panic!("deploy/kubeadm: unexpected {other:?}"),
        }
    }
    let [daemonset] = <[DaemonSet; 1]>::try_from(daemonsets).expect("one DaemonSet");
    let [drill] = <[CronJob; 1]>::try_from(crons).expect("one CronJob: the drill");
    KubeadmDeploy {
        daemonset,
        drill,
        config_maps: k.config_maps,
    }
}

/// Where kubeadm writes the etcd certificates on a control-plane node.
const KUBEADM_ETCD_PKI: &str = "/etc/kubernetes/pki/etcd";

/// Everything wrong with deploy/kubeadm (issue 56, item 3): a DaemonSet on the control-plane
/// nodes (their role label and taint), on the host network, reaching only its own node's member
/// at https://127.0.0.1:2379 with the etcd CA and a client certificate mounted read-only from
/// the node file by file (never the directory, which holds the CA's key), no `[owner]` or
/// `[kill]` and no shared PID namespace, deltas and fulls scheduled, probes on `server.listen`'s
/// port, the store's and the token's files from their Secrets, and the drill reading the same
/// store.
fn kubeadm_problems(
    d: &KubeadmDeploy,
    secrets: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<String> {
    let mut out = Vec::new();
    let Some(pod) = d
        .daemonset
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
    else {
        return vec!["the DaemonSet has no pod spec".into()];
    };
    const ROLE: &str = "node-role.kubernetes.io/control-plane";
    if !pod
        .node_selector
        .as_ref()
        .is_some_and(|s| s.contains_key(ROLE))
    {
        out.push(format!(
            "nodeSelector must select {ROLE}: etcd's static pods run there"
        ));
    }
    let tolerated = pod.tolerations.iter().flatten().any(|t| {
        t.key.as_deref() == Some(ROLE)
            && t.operator.as_deref() == Some("Exists")
            && t.effect.as_deref().is_none_or(|e| e == "NoSchedule")
    });
    if !tolerated {
        out.push(format!(
            "no toleration of the {ROLE}:NoSchedule taint kubeadm sets"
        ));
    }
    if pod.host_network != Some(true) {
        out.push("hostNetwork must be true: the node's member listens on 127.0.0.1".into());
    }
    if pod.share_process_namespace == Some(true) {
        out.push("shareProcessNamespace: nothing here may signal etcd".into());
    }
    let side = match sidecar(pod) {
        Ok(c) => c,
        Err(e) => {
            out.push(e);
            return out;
        }
    };
    out.extend(hardening_problems(side, &[]));
    out.extend(secret_env_problems(pod));
    let (text, raw) = match mounted_toml(pod, side, &d.config_maps, "sidecar") {
        Ok(t) => t,
        Err(e) => {
            out.push(e);
            return out;
        }
    };
    for section in ["owner", "kill"] {
        if raw.contains_key(section) {
            out.push(format!(
                "[{section}] in the config: a kubeadm etcd has no owner to hand it over, and \
                 this pod shares no PID namespace with it"
            ));
        }
    }
    out.extend(subcommand_config_problem(side, &text));
    let effective = effective_config(side, &text);
    let endpoints: Vec<&str> = get(&effective, "etcd.endpoints")
        .and_then(|v| v.as_array())
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str())
        .collect();
    if endpoints != ["https://127.0.0.1:2379"] {
        out.push(format!(
            "etcd.endpoints = {endpoints:?}: must be only this node's member, \
             [\"https://127.0.0.1:2379\"]"
        ));
    }
    if get(&effective, "restore.initialize").and_then(|v| v.as_bool()) == Some(true) {
        out.push("restore.initialize: the kubelet starts etcd whatever this pod does".into());
    }
    if get_str(&effective, "snapshot.schedule").is_empty() {
        out.push("snapshot.schedule is empty: no full snapshots".into());
    }
    if humantime::parse_duration(get_str(&effective, "snapshot.delta_period"))
        .is_ok_and(|p| p.is_zero())
    {
        out.push("snapshot.delta_period is 0s: no deltas".into());
    }

    // The etcd client files: each a read-only mount of the same file on the node, under
    // kubeadm's etcd directory. Every hostPath volume is one of them.
    let mut host_files = BTreeSet::new();
    // (The file's paths: `etcd-warden config` prints the local stand-ins of local_config.)
    for key in ["etcd.ca_file", "etcd.cert_file", "etcd.key_file"] {
        let path = get_str(&raw, key);
        if path.is_empty() {
            out.push(format!(
                "{key} is not set: kubeadm's etcd requires client certificates"
            ));
            continue;
        }
        let mount = side
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.mount_path == path);
        let Some(mount) = mount else {
            out.push(format!("{key} = {path:?}: no file mounted there"));
            continue;
        };
        if mount.read_only != Some(true) {
            out.push(format!("{key}: the mount of {path} must be readOnly"));
        }
        match volume(pod, &mount.name).and_then(|v| v.host_path.as_ref()) {
            None => out.push(format!("{key}: volume {} is not a hostPath", mount.name)),
            Some(h) => {
                if !Path::new(&h.path).starts_with(KUBEADM_ETCD_PKI) {
                    out.push(format!("{key}: {} is not under {KUBEADM_ETCD_PKI}", h.path));
                }
                if h.type_.as_deref() != Some("File") {
                    out.push(format!(
                        "{key}: hostPath {} must be of type File (one file, not the directory \
                         holding the CA's key)",
                        h.path
                    ));
                }
                host_files.insert(mount.name.clone());
            }
        }
    }
    for v in pod.volumes.iter().flatten() {
        if let Some(h) = v.host_path.as_ref()
            && !host_files.contains(&v.name)
        {
            out.push(format!(
                "hostPath volume {} ({}) is none of the etcd client files: nothing else of \
                 the node belongs in the pod",
                v.name, h.path
            ));
        }
    }
    for (key, path) in file_keys(&raw) {
        if !key.starts_with("etcd.") {
            out.extend(secret_file_problem(pod, side, &key, &path, None, secrets));
        }
    }
    if !file_keys(&raw).iter().any(|(k, _)| k.starts_with("store.")) {
        out.push("[store] reads no credentials from etcd-backup".into());
    }

    // The probes reach server.listen on the node's IP.
    let listen: Option<SocketAddr> = get_str(&effective, "server.listen").parse().ok();
    let port = listen.map(|a| i32::from(a.port()));
    if listen.is_none_or(|a| a.ip().to_canonical().is_loopback()) {
        out.push(format!(
            "server.listen {listen:?}: the kubelet's probes reach the node's IP, not loopback"
        ));
    }
    for (what, probe) in [
        ("liveness", side.liveness_probe.as_ref()),
        ("startup", side.startup_probe.as_ref()),
    ] {
        match probe.and_then(|p| p.http_get.as_ref()) {
            None => out.push(format!("no httpGet {what} probe")),
            Some(g) if resolve_port(pod, &g.port) != port => out.push(format!(
                "the {what} probe's port {:?} is not server.listen's {port:?}",
                g.port
            )),
            Some(_) => {}
        }
    }

    // The drill restores what these pods store.
    out.extend(job_cronjob_problems(
        &d.drill,
        &["verify", "--restore"],
        &d.config_maps,
        secrets,
    ));
    let drill_pod = d
        .drill
        .spec
        .as_ref()
        .and_then(|s| s.job_template.spec.as_ref())
        .and_then(|s| s.template.spec.as_ref());
    if let Some(dp) = drill_pod
        && let Some(c) = dp.containers.first()
        && let Ok((_, drill)) = mounted_toml(dp, c, &d.config_maps, "the drill's")
    {
        let (theirs, ours) = (get_str(&drill, "store.url"), get_str(&raw, "store.url"));
        if theirs != ours {
            out.push(format!(
                "the drill reads store.url {theirs:?}, the DaemonSet writes {ours:?}"
            ));
        }
    }
    out
}

#[test]
fn the_kubeadm_daemonset_backs_up_the_nodes_member_with_its_client_certificate() {
    let problems = kubeadm_problems(&kubeadm_deploy(), &example_secrets());
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn a_broken_kubeadm_daemonset_is_rejected() {
    let good = kubeadm_deploy();
    let secrets = example_secrets();
    fn pod(d: &mut KubeadmDeploy) -> &mut PodSpec {
        d.daemonset
            .spec
            .as_mut()
            .and_then(|s| s.template.spec.as_mut())
            .expect("pod spec")
    }
    fn config(d: &mut KubeadmDeploy) -> &mut String {
        d.config_maps
            .get_mut("etcd-warden-config")
            .and_then(|m| m.get_mut("config.toml"))
            .expect("config.toml")
    }
    fn edit(d: &mut KubeadmDeploy, from: &str, to: &str) {
        let text = config(d);
        assert!(text.contains(from), "config.toml has no {from:?}");
        *text = text.replace(from, to);
    }
    type Mutation = Box<dyn Fn(&mut KubeadmDeploy)>;
    let mutations: Vec<(&str, &str, Mutation)> = vec![
        (
            "on every node",
            "nodeSelector",
            Box::new(|d| pod(d).node_selector = None),
        ),
        (
            "the control-plane taint not tolerated",
            "toleration",
            Box::new(|d| pod(d).tolerations = None),
        ),
        (
            "in the pod network",
            "hostNetwork",
            Box::new(|d| pod(d).host_network = None),
        ),
        (
            "a shared PID namespace",
            "shareProcessNamespace",
            Box::new(|d| pod(d).share_process_namespace = Some(true)),
        ),
        (
            "an owner section",
            "[owner]",
            Box::new(|d| {
                config(d).push_str("\n[owner]\nname = \"owner.example.internal\"\nid = \"a\"\n")
            }),
        ),
        (
            "another node's member",
            "etcd.endpoints",
            Box::new(|d| edit(d, "https://127.0.0.1:2379", "https://10.0.0.12:2379")),
        ),
        (
            "no client certificate",
            "etcd.cert_file is not set",
            Box::new(|d| {
                edit(
                    d,
                    "cert_file = \"/etc/kubernetes/pki/etcd/healthcheck-client.crt\"",
                    "",
                );
                edit(
                    d,
                    "key_file = \"/etc/kubernetes/pki/etcd/healthcheck-client.key\"",
                    "",
                )
            }),
        ),
        (
            "the key mounted writable",
            "must be readOnly",
            Box::new(|d| {
                for m in pod(d).containers[0].volume_mounts.iter_mut().flatten() {
                    if m.name == "etcd-client-key" {
                        m.read_only = None;
                    }
                }
            }),
        ),
        (
            "the whole pki/etcd directory",
            "must be of type File",
            Box::new(|d| {
                for v in pod(d).volumes.iter_mut().flatten() {
                    if v.name == "etcd-ca"
                        && let Some(h) = v.host_path.as_mut()
                    {
                        h.type_ = Some("Directory".into());
                    }
                }
            }),
        ),
        (
            "the CA's key mounted too",
            "none of the etcd client files",
            Box::new(|d| {
                let p = pod(d);
                let mut ca_key = p
                    .volumes
                    .iter()
                    .flatten()
                    .find(|v| v.name == "etcd-ca")
                    .expect("the etcd-ca volume")
                    .clone();
                ca_key.name = "etcd-ca-key".into();
                ca_key.host_path.as_mut().expect("hostPath").path =
                    format!("{KUBEADM_ETCD_PKI}/ca.key");
                p.volumes.as_mut().expect("volumes").push(ca_key);
            }),
        ),
        (
            "the sidecar's API on loopback only",
            "server.listen",
            Box::new(|d| {
                edit(
                    d,
                    "listen = \"0.0.0.0:2390\"",
                    "listen = \"127.0.0.1:2390\"",
                )
            }),
        ),
        (
            "no deltas",
            "delta_period is 0s",
            Box::new(|d| edit(d, "delta_period = \"20s\"", "delta_period = \"0s\"")),
        ),
        (
            "the drill on another bucket",
            "the drill reads store.url",
            Box::new(|d| {
                let drill = d
                    .config_maps
                    .get_mut("etcd-warden-drill-config")
                    .and_then(|m| m.get_mut("drill.toml"))
                    .expect("drill.toml");
                *drill = drill.replace("s3://etcd-backup/kubeadm", "s3://etcd-backup/etcd-main");
            }),
        ),
    ];
    for (what, expected, mutate) in mutations {
        let mut d = good.clone();
        mutate(&mut d);
        let problems = kubeadm_problems(&d, &secrets);
        assert!(
            problems.iter().any(|p| p.contains(expected)),
            "{what}: expected a problem containing {expected:?}, got {problems:#?}"
        );
    }
}
