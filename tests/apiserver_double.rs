//! The Kubernetes API server double (`support::apiserver`) against the real kube-rs client: the
//! behaviours the operator's safety rests on (409 on a stale resourceVersion, watches resuming
//! after a given version, finalizers holding a deletion) checked before anything relies on them.

use crate::support;

use std::collections::BTreeMap;
use std::time::Duration;

use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube::runtime::watcher;
use serde_json::json;
use support::apiserver::{ApiServer, Res};

fn cm(name: &str, data: &[(&str, &str)]) -> ConfigMap {
    ConfigMap {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        data: Some(
            data.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
        ),
        ..Default::default()
    }
}

fn machines(client: kube::Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("machine.openshift.io", "v1beta1", "Machine");
    Api::namespaced_with(client, "default", &ApiResource::from_gvk(&gvk))
}

fn api_error(e: kube::Error) -> kube::core::Status {
    match e {
        kube::Error::Api(s) => *s,
        other => panic!("expected an API error, got {other}"),
    }
}

/// The double, and the ConfigMaps of its default namespace.
async fn start() -> (ApiServer, Api<ConfigMap>) {
    let server = ApiServer::start().await;
    let api = Api::default_namespaced(server.client());
    (server, api)
}

/// Creates the ConfigMap `name` holding `data`.
async fn create(api: &Api<ConfigMap>, name: &str, data: &[(&str, &str)]) -> ConfigMap {
    api.create(&PostParams::default(), &cm(name, data))
        .await
        .unwrap()
}

/// Merge-patches the object `name` with `patch`.
async fn merge<K>(api: &Api<K>, name: &str, patch: &serde_json::Value) -> kube::Result<K>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
}

/// Next watch event within 5 s.
async fn next<S>(s: &mut S) -> WatchEvent<ConfigMap>
where
    S: futures::Stream<Item = kube::Result<WatchEvent<ConfigMap>>> + Unpin,
{
    tokio::time::timeout(Duration::from_secs(5), s.next())
        .await
        .expect("a watch event within 5s")
        .expect("the stream is open")
        .expect("a well-formed event")
}

fn name_of(ev: &WatchEvent<ConfigMap>) -> (&'static str, String) {
    match ev {
        WatchEvent::Added(o) => ("ADDED", o.metadata.name.clone().unwrap_or_default()),
        WatchEvent::Modified(o) => ("MODIFIED", o.metadata.name.clone().unwrap_or_default()),
        WatchEvent::Deleted(o) => ("DELETED", o.metadata.name.clone().unwrap_or_default()),
        WatchEvent::Bookmark(_) => ("BOOKMARK", String::new()),
        WatchEvent::Error(s) => panic!("watch error {s:?}"),
    }
}

#[tokio::test]
async fn stale_resource_version_is_a_409_conflict() {
    let (_server, api) = start().await;
    let created = create(&api, "a", &[("k", "1")]).await;
    let stale = created.metadata.resource_version.clone().unwrap();

    let again = api.create(&PostParams::default(), &cm("a", &[])).await;
    assert!(api_error(again.unwrap_err()).is_already_exists());

    let mut fresh = created.clone();
    fresh.data = Some([("k".to_string(), "2".to_string())].into());
    let updated = api
        .replace("a", &PostParams::default(), &fresh)
        .await
        .unwrap();
    let current = updated.metadata.resource_version.clone().unwrap();
    assert!(current.parse::<u64>().unwrap() > stale.parse::<u64>().unwrap());

    // PUT with the version read before the update.
    let mut old = created.clone();
    old.data = Some([("k".to_string(), "3".to_string())].into());
    let s = api_error(
        api.replace("a", &PostParams::default(), &old)
            .await
            .unwrap_err(),
    );
    assert!(s.is_conflict(), "{s:?}");
    assert_eq!(s.code, 409);

    // A merge patch carrying the stale version.
    let p = json!({"metadata": {"resourceVersion": stale}, "data": {"k": "4"}});
    let s = api_error(merge(&api, "a", &p).await.unwrap_err());
    assert!(s.is_conflict(), "{s:?}");

    // With the current version it goes through; the data is the last accepted write's.
    let p = json!({"metadata": {"resourceVersion": current}, "data": {"k": "5"}});
    let ok = merge(&api, "a", &p).await.unwrap();
    assert_eq!(ok.data.unwrap()["k"], "5");

    // A delete precondition on a stale version.
    let dp = DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            resource_version: Some(stale),
            uid: None,
        }),
        ..Default::default()
    };
    assert!(api_error(api.delete("a", &dp).await.unwrap_err()).is_conflict());
    assert!(api.get_opt("a").await.unwrap().is_some());
}

#[tokio::test]
async fn a_write_that_changes_nothing_keeps_the_version() {
    let (_server, api) = start().await;
    let c = create(&api, "a", &[("k", "1")]).await;
    let p = json!({"data": {"k": "1"}});
    let same = merge(&api, "a", &p).await.unwrap();
    assert_eq!(same.metadata.resource_version, c.metadata.resource_version);
}

#[tokio::test]
async fn watch_from_a_version_delivers_only_later_events_then_live_ones() {
    let (_server, api) = start().await;
    create(&api, "a", &[]).await;
    create(&api, "b", &[]).await;
    let list = api.list(&ListParams::default()).await.unwrap();
    let rv = list.metadata.resource_version.clone().unwrap();
    assert_eq!(list.items.len(), 2);

    let p = json!({"data": {"x": "1"}});
    merge(&api, "a", &p).await.unwrap();
    api.delete("b", &DeleteParams::default()).await.unwrap();

    let mut w = api
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    assert_eq!(name_of(&next(&mut w).await), ("MODIFIED", "a".into()));
    assert_eq!(name_of(&next(&mut w).await), ("DELETED", "b".into()));
    create(&api, "c", &[]).await;
    assert_eq!(name_of(&next(&mut w).await), ("ADDED", "c".into()));

    // Without a version: the current state first.
    let mut w0 = api
        .watch(&WatchParams::default(), "0")
        .await
        .unwrap()
        .boxed();
    let mut names = vec![name_of(&next(&mut w0).await), name_of(&next(&mut w0).await)];
    names.sort();
    assert_eq!(names, vec![("ADDED", "a".into()), ("ADDED", "c".into())]);
}

#[tokio::test]
async fn watch_with_a_label_selector_sees_objects_enter_and_leave() {
    let (server, api) = start().await;
    let rv = server.resource_version().to_string();
    let wp = WatchParams::default().labels("role=master");
    let mut w = api.watch(&wp, &rv).await.unwrap().boxed();
    create(&api, "a", &[]).await;
    let p = json!({"metadata": {"labels": {"role": "master"}}});
    merge(&api, "a", &p).await.unwrap();
    assert_eq!(name_of(&next(&mut w).await), ("ADDED", "a".into()));
    let p = json!({"metadata": {"labels": {"role": null}}});
    merge(&api, "a", &p).await.unwrap();
    assert_eq!(name_of(&next(&mut w).await), ("DELETED", "a".into()));

    let listed = api
        .list(&ListParams::default().labels("role in (master,worker)"))
        .await
        .unwrap();
    assert!(listed.items.is_empty());
    let listed = api
        .list(&ListParams::default().labels("!role"))
        .await
        .unwrap();
    assert_eq!(listed.items.len(), 1);
}

#[tokio::test]
async fn a_watch_from_before_a_compaction_is_410_gone() {
    let (server, api) = start().await;
    let rv = server.resource_version().to_string();
    create(&api, "a", &[]).await;
    server.compact();
    let mut w = api
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    match next(&mut w).await {
        WatchEvent::Error(s) => assert_eq!(s.code, 410),
        other => panic!("expected a 410, got {other:?}"),
    }
}

#[tokio::test]
async fn finalizers_hold_a_deletion_until_the_last_is_removed() {
    let (server, api) = start().await;
    let mut obj = cm("a", &[]);
    obj.metadata.finalizers = Some(vec!["example.com/one".into(), "example.com/two".into()]);
    api.create(&PostParams::default(), &obj).await.unwrap();
    let rv = server.resource_version().to_string();
    let mut w = api
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();

    api.delete("a", &DeleteParams::default()).await.unwrap();
    let held = api.get("a").await.unwrap();
    let ts = held
        .metadata
        .deletion_timestamp
        .clone()
        .expect("deletionTimestamp set");
    assert_eq!(name_of(&next(&mut w).await), ("MODIFIED", "a".into()));

    // A second delete changes nothing; the timestamp cannot be written.
    api.delete("a", &DeleteParams::default()).await.unwrap();
    let p = json!({"metadata": {"deletionTimestamp": null}});
    merge(&api, "a", &p).await.unwrap();
    assert_eq!(
        api.get("a").await.unwrap().metadata.deletion_timestamp,
        Some(ts)
    );

    // No new finalizer while deleting.
    let p = json!({"metadata": {"finalizers": ["example.com/one", "example.com/two", "example.com/three"]}});
    let s = api_error(merge(&api, "a", &p).await.unwrap_err());
    assert!(s.is_invalid(), "{s:?}");

    let p = json!({"metadata": {"finalizers": ["example.com/two"]}});
    merge(&api, "a", &p).await.unwrap();
    assert!(api.get_opt("a").await.unwrap().is_some());
    assert_eq!(name_of(&next(&mut w).await), ("MODIFIED", "a".into()));

    let p = json!({"metadata": {"finalizers": null}});
    merge(&api, "a", &p).await.unwrap();
    assert!(api.get_opt("a").await.unwrap().is_none());
    assert_eq!(name_of(&next(&mut w).await), ("MODIFIED", "a".into()));
    assert_eq!(name_of(&next(&mut w).await), ("DELETED", "a".into()));
}

#[tokio::test]
async fn status_subresource_separates_spec_and_status_writes() {
    let server = ApiServer::start().await;
    let api = machines(server.client());
    let m: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "machine.openshift.io/v1beta1",
        "kind": "Machine",
        "metadata": {"name": "m1"},
        "spec": {"providerID": "p"},
        "status": {"phase": "Running"},
    }))
    .unwrap();
    let created = api.create(&PostParams::default(), &m).await.unwrap();
    assert!(created.data.get("status").is_none(), "create drops status");
    assert_eq!(created.metadata.generation, Some(1));

    let p = json!({"status": {"phase": "Running"}, "spec": {"providerID": "q"}});
    let s = api
        .patch_status("m1", &PatchParams::default(), &Patch::Merge(&p))
        .await
        .unwrap();
    assert_eq!(s.data["status"]["phase"], "Running");
    assert_eq!(
        s.data["spec"]["providerID"], "p",
        "a status write leaves spec alone"
    );
    assert_eq!(s.metadata.generation, Some(1));

    let p = json!({"status": {"phase": "Deleting"}, "spec": {"providerID": "q"}});
    let s = merge(&api, "m1", &p).await.unwrap();
    assert_eq!(
        s.data["status"]["phase"], "Running",
        "a spec write leaves status alone"
    );
    assert_eq!(s.data["spec"]["providerID"], "q");
    assert_eq!(s.metadata.generation, Some(2));
    let stored = server
        .get(
            &Res::new("machine.openshift.io", "v1beta1", "machines"),
            "default",
            "m1",
        )
        .unwrap();
    assert_eq!(stored["spec"]["providerID"], "q");
}

#[tokio::test]
async fn json_patch_applies_and_a_failed_test_is_422() {
    let (_server, api) = start().await;
    let c = create(&api, "a", &[("k", "1")]).await;
    let rv = c.metadata.resource_version.unwrap();
    let ops: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "add", "path": "/data/j", "value": "2"},
        {"op": "remove", "path": "/data/k"},
    ]))
    .unwrap();
    let ok = api
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::<()>::Json(ops.clone()),
        )
        .await
        .unwrap();
    assert_eq!(
        ok.data.unwrap(),
        [("j".to_string(), "2".to_string())].into()
    );
    let s = api_error(
        api.patch("a", &PatchParams::default(), &Patch::<()>::Json(ops))
            .await
            .unwrap_err(),
    );
    assert_eq!(s.code, 422, "{s:?}");
}

#[tokio::test]
async fn injected_conflicts_make_the_first_conditional_write_fail_once() {
    let (server, api) = start().await;
    create(&api, "a", &[]).await;
    server.inject_conflicts(true);
    let read = api.get("a").await.unwrap();
    let p = json!({"metadata": {"resourceVersion": read.metadata.resource_version}, "data": {"k": "1"}});
    let s = api_error(merge(&api, "a", &p).await.unwrap_err());
    assert!(s.is_conflict());
    let read = api.get("a").await.unwrap();
    let p = json!({"metadata": {"resourceVersion": read.metadata.resource_version}, "data": {"k": "1"}});
    merge(&api, "a", &p).await.unwrap();
}

#[tokio::test]
async fn the_runtime_watcher_lists_then_follows_changes() {
    let (_server, api) = start().await;
    create(&api, "a", &[]).await;
    let mut events = watcher(api.clone(), watcher::Config::default()).boxed();
    let mut seen = Vec::new();
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(5), events.try_next())
            .await
            .expect("an event within 5s")
            .expect("no watcher error")
            .expect("the stream is open");
        match ev {
            watcher::Event::InitApply(o) => seen.push(o.metadata.name.unwrap()),
            watcher::Event::InitDone => break,
            _ => {}
        }
    }
    assert_eq!(seen, vec!["a".to_string()]);
    create(&api, "b", &[]).await;
    let ev = tokio::time::timeout(Duration::from_secs(5), events.try_next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(matches!(ev, watcher::Event::Apply(o) if o.metadata.name.as_deref() == Some("b")));
}

#[tokio::test]
async fn a_kubeconfig_names_the_double() {
    let server = ApiServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    server.write_kubeconfig(&path, "etcd");
    let kc = kube::config::Kubeconfig::read_from(&path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    assert_eq!(config.default_namespace, "etcd");
    let api: Api<ConfigMap> = Api::default_namespaced(kube::Client::try_from(config).unwrap());
    create(&api, "a", &[]).await;
    assert!(
        server
            .get(&Res::new("", "v1", "configmaps"), "etcd", "a")
            .is_some()
    );
}

fn owned_cm(name: &str, owners: &[(&str, &str, bool)], finalizers: &[&str]) -> ConfigMap {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
    ConfigMap {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            finalizers: Some(finalizers.iter().map(|f| f.to_string()).collect()),
            owner_references: Some(
                owners
                    .iter()
                    .map(|(n, uid, block)| OwnerReference {
                        api_version: "v1".into(),
                        kind: "ConfigMap".into(),
                        name: n.to_string(),
                        uid: uid.to_string(),
                        controller: Some(true),
                        block_owner_deletion: Some(*block),
                    })
                    .collect(),
            ),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// kube-controller-manager's garbage collector, as the double plays it: orphan takes the owner
/// references off, background deletes dependents once the owner is gone, foreground deletes
/// them first and keeps the owner until no blocking dependent is left, and a dependent with
/// another live owner only loses its reference.
#[tokio::test]
async fn the_garbage_collector_honours_the_propagation_policy() {
    let server = ApiServer::start().await;
    server.collect_garbage();
    let api: Api<ConfigMap> = Api::namespaced(server.client(), "default");
    let pp = PostParams::default();
    let make = async |name: &str| {
        api.create(&pp, &cm(name, &[]))
            .await
            .unwrap()
            .metadata
            .uid
            .unwrap()
    };
    let exists = async |name: &str| api.get_opt(name).await.unwrap();

    // Orphan.
    let u = make("o1").await;
    api.create(&pp, &owned_cm("d1", &[("o1", &u, true)], &[]))
        .await
        .unwrap();
    api.delete("o1", &DeleteParams::orphan()).await.unwrap();
    assert!(exists("o1").await.is_none());
    let d1 = exists("d1").await.expect("d1 orphaned, not deleted");
    assert!(d1.metadata.owner_references.unwrap_or_default().is_empty());

    // Background (the default).
    let u = make("o2").await;
    api.create(&pp, &owned_cm("d2", &[("o2", &u, false)], &[]))
        .await
        .unwrap();
    api.delete("o2", &DeleteParams::default()).await.unwrap();
    assert!(exists("o2").await.is_none() && exists("d2").await.is_none());

    // Foreground: the dependent is deleted first; the owner waits while it is held.
    let u = make("o3").await;
    api.create(&pp, &owned_cm("d3", &[("o3", &u, true)], &["hold"]))
        .await
        .unwrap();
    api.delete("o3", &DeleteParams::foreground()).await.unwrap();
    let o3 = exists("o3").await.expect("the owner waits");
    assert!(o3.metadata.deletion_timestamp.is_some());
    assert_eq!(o3.metadata.finalizers.unwrap(), ["foregroundDeletion"]);
    assert!(
        exists("d3")
            .await
            .unwrap()
            .metadata
            .deletion_timestamp
            .is_some()
    );
    api.patch(
        "d3",
        &PatchParams::default(),
        &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    assert!(exists("d3").await.is_none() && exists("o3").await.is_none());

    // Foreground with a second owner alive: the dependent stays, without the reference.
    let u4 = make("o4").await;
    let u5 = make("o5").await;
    api.create(
        &pp,
        &owned_cm("d4", &[("o4", &u4, true), ("o5", &u5, false)], &[]),
    )
    .await
    .unwrap();
    api.delete("o4", &DeleteParams::foreground()).await.unwrap();
    let d4 = exists("d4").await.expect("kept by its other owner");
    let refs = d4.metadata.owner_references.unwrap();
    assert_eq!(refs.len(), 1);
    assert_eq!(refs[0].uid, u5);
    assert!(exists("o4").await.is_none());
    let collected: Vec<String> = server.collected().into_iter().map(|(_, n)| n).collect();
    assert_eq!(collected, ["d2", "d3"]);
}

/// OpenShift's `OwnerReferencesPermissionEnforcement` (issue 29: `cannot set blockOwnerDeletion
/// if an ownerReference refers to a resource you can't set finalizers on`), judged by RBAC.
#[tokio::test]
async fn owner_references_need_delete_and_block_owner_deletion_needs_the_owners_finalizers() {
    let dir = tempfile::tempdir().unwrap();
    let rbac = |extra: &str| {
        let path = dir.path().join(format!("rbac{}.yaml", extra.len()));
        std::fs::write(
            &path,
            format!(
                "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {{name: op, namespace: default}}\n\
                 rules:\n- apiGroups: [machine.openshift.io]\n  resources: [machines]\n  verbs: [get, patch, delete]\n{extra}\
                 ---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {{name: op, namespace: default}}\n\
                 roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: op}}\n\
                 subjects: [{{kind: ServiceAccount, name: op, namespace: default}}]\n"
            ),
        )
        .unwrap();
        support::rbac::Policy::load(&[&path])
    };
    let server = ApiServer::start().await;
    machines(server.client())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "machine.openshift.io/v1beta1", "kind": "Machine",
                "metadata": {"name": "m1"},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let op = machines(server.client_as("op"));
    let owner = |block: bool| {
        json!({"metadata": {"ownerReferences": [{
            "apiVersion": "etcd-warden.io/v1alpha1", "kind": "ControlPlaneSet",
            "name": "cluster", "uid": "set-uid", "controller": true, "blockOwnerDeletion": block,
        }]}})
    };
    let set = async |p: serde_json::Value| {
        op.patch("m1", &PatchParams::default(), &Patch::Merge(&p))
            .await
    };

    server.enforce_owner_references(rbac(""), &[("op", ("default", "op"))]);
    let e = api_error(set(owner(true)).await.unwrap_err());
    assert_eq!((e.code, e.reason.as_str()), (403, "Forbidden"));
    assert!(
        e.message.contains(
            "cannot set blockOwnerDeletion if an ownerReference refers to a resource you can't set finalizers on"
        ),
        "{}",
        e.message
    );
    // Without blockOwnerDeletion, `delete` on the Machine is enough.
    set(owner(false)).await.unwrap();
    set(json!({"metadata": {"ownerReferences": null}}))
        .await
        .unwrap();
    // With `update` on the owner's finalizers, blocking is allowed too.
    server.enforce_owner_references(
        rbac("- apiGroups: [etcd-warden.io]\n  resources: [controlplanesets/finalizers]\n  verbs: [update]\n"),
        &[("op", ("default", "op"))],
    );
    set(owner(true)).await.unwrap();
    // Without `delete` on the Machine, no owner reference may change at all.
    let path = dir.path().join("nodelete.yaml");
    std::fs::write(
        &path,
        std::fs::read_to_string(dir.path().join("rbac0.yaml"))
            .unwrap()
            .replace("[get, patch, delete]", "[get, patch]"),
    )
    .unwrap();
    server.enforce_owner_references(
        support::rbac::Policy::load(&[&path]),
        &[("op", ("default", "op"))],
    );
    let e = api_error(set(owner(false)).await.unwrap_err());
    assert!(
        e.message
            .contains("cannot set an ownerRef on a resource you can't delete"),
        "{}",
        e.message
    );
    // Any other change is not the plugin's business; nor is a user it does not know.
    set(json!({"metadata": {"labels": {"a": "b"}}}))
        .await
        .unwrap();
    machines(server.client())
        .patch("m1", &PatchParams::default(), &Patch::Merge(&owner(false)))
        .await
        .unwrap();
}
