//! The objects the operator keeps in step on Kubernetes — the `etcd-endpoints` ConfigMap and the
//! quorum-guard PodDisruptionBudget — written through the real kube client to the API server
//! double (`support::apiserver`): created when missing, patched only when they differ, a removed
//! member's key gone, and converging when a concurrent writer makes the first write conflict.

use crate::support;

use std::collections::BTreeMap;

use etcd_warden::operator::kube::endpoints;
use etcd_warden::operator::kube::quorum_guard::QuorumGuard;
use etcd_warden::operator::quorum::plan::MemberState;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::Api;
use support::apiserver::ApiServer;

const NS: &str = "openshift-etcd";

fn member(id: u64, ip: &str, learner: bool) -> MemberState {
    MemberState {
        id,
        name: String::new(),
        peer_urls: vec![format!("https://{ip}:2380")],
        is_learner: learner,
        healthy: false,
        applied_index: 0,
    }
}

async fn data(api: &Api<ConfigMap>) -> BTreeMap<String, String> {
    api.get(endpoints::NAME)
        .await
        .unwrap()
        .data
        .unwrap_or_default()
}

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[tokio::test]
async fn endpoints_follow_the_member_list() {
    let server = ApiServer::start().await;
    let api: Api<ConfigMap> = Api::namespaced(server.client(), NS);
    let three = [
        member(0xa1, "10.0.0.1", false),
        member(0xb2, "10.0.0.2", false),
        member(0xc3, "10.0.0.3", false),
    ];
    assert!(endpoints::sync(&api, NS, &three).await.unwrap());
    assert_eq!(
        data(&api).await,
        map(&[("a1", "10.0.0.1"), ("b2", "10.0.0.2"), ("c3", "10.0.0.3")])
    );

    // Nothing differs: nothing written.
    let rv = server.resource_version();
    assert!(!endpoints::sync(&api, NS, &three).await.unwrap());
    assert_eq!(server.resource_version(), rv);

    // A learner added (not started yet), then the replaced member removed.
    let mut four = three.to_vec();
    four.push(member(0xd4, "10.0.0.4", true));
    assert!(endpoints::sync(&api, NS, &four).await.unwrap());
    assert_eq!(
        data(&api).await.get("d4").map(String::as_str),
        Some("10.0.0.4")
    );
    let after: Vec<MemberState> = four.into_iter().filter(|m| m.id != 0xa1).collect();
    assert!(endpoints::sync(&api, NS, &after).await.unwrap());
    assert_eq!(
        data(&api).await,
        map(&[("b2", "10.0.0.2"), ("c3", "10.0.0.3"), ("d4", "10.0.0.4")])
    );
}

#[tokio::test]
async fn endpoints_converge_when_the_first_write_conflicts() {
    let server = ApiServer::start().await;
    let api: Api<ConfigMap> = Api::namespaced(server.client(), NS);
    endpoints::sync(&api, NS, &[member(1, "10.0.0.1", false)])
        .await
        .unwrap();
    server.inject_conflicts(true);
    endpoints::sync(&api, NS, &[member(2, "10.0.0.2", false)])
        .await
        .unwrap();
    assert_eq!(data(&api).await, map(&[("2", "10.0.0.2")]));
    let patches = server
        .requests()
        .iter()
        .filter(|r| r.starts_with("PATCH ") && r.contains("/configmaps/etcd-endpoints"))
        .count();
    assert_eq!(patches, 2, "one refused, one after reading again");
}

#[tokio::test]
async fn endpoints_are_not_written_for_a_member_without_an_ip() {
    let server = ApiServer::start().await;
    let api: Api<ConfigMap> = Api::namespaced(server.client(), NS);
    let mut bad = member(1, "x", false);
    bad.peer_urls = vec!["https://etcd-0.example:2380".into()];
    let e = endpoints::sync(&api, NS, &[bad]).await.unwrap_err();
    assert!(!e.is_transient(), "{e}");
    assert!(api.get_opt(endpoints::NAME).await.unwrap().is_none());
}

#[tokio::test]
async fn the_quorum_guard_follows_the_machine_count() {
    let server = ApiServer::start().await;
    let guard = QuorumGuard::default();
    let api: Api<PodDisruptionBudget> = Api::namespaced(server.client(), &guard.namespace);
    let min = |p: PodDisruptionBudget| p.spec.unwrap().min_available;

    assert!(guard.sync(&api, 3).await.unwrap());
    assert_eq!(
        min(api.get(&guard.name).await.unwrap()),
        Some(IntOrString::Int(2))
    );
    let rv = server.resource_version();
    assert!(!guard.sync(&api, 3).await.unwrap());
    assert_eq!(server.resource_version(), rv);

    server.inject_conflicts(true);
    assert!(guard.sync(&api, 4).await.unwrap());
    assert_eq!(
        min(api.get(&guard.name).await.unwrap()),
        Some(IntOrString::Int(3))
    );
    assert!(guard.sync(&api, 3).await.unwrap());
    let pdb = api.get(&guard.name).await.unwrap();
    assert!(guard.is_current(&pdb, 3));
}

#[test]
fn the_kube_client_builds_its_tls_connector_with_one_crypto_provider() {
    // rustls panics when two crypto providers are compiled in and none is installed; building
    // an https client constructs the rustls configuration kube uses.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _guard = rt.enter();
    let config = kube::Config::new("https://127.0.0.1:6443".parse().unwrap());
    kube::Client::try_from(config).expect("an https kube client");
}

#[tokio::test]
async fn every_action_and_every_persisting_failure_becomes_an_event_on_its_machine() {
    use etcd_warden::operator::kube::events;
    use etcd_warden::operator::quorum::execute::ActionRecord;
    use etcd_warden::operator::quorum::plan::Action;
    use k8s_openapi::api::core::v1::ObjectReference;
    use k8s_openapi::api::events::v1::Event;
    use kube::runtime::events::{Recorder, Reporter};

    let server = ApiServer::start().await;
    let client = server.client();
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "etcd-warden-operator".into(),
            instance: Some("op-0".into()),
        },
    );
    let (tx, rx) = tokio::sync::broadcast::channel(16);
    let cancel = tokio_util::sync::CancellationToken::new();
    let fallback = ObjectReference {
        kind: Some("ConfigMap".into()),
        name: Some("etcd-endpoints".into()),
        namespace: Some(NS.into()),
        ..ObjectReference::default()
    };
    let metrics = events::EventMetrics::default();
    let task = tokio::spawn(events::publish(
        rx,
        recorder,
        "openshift-machine-api".into(),
        fallback,
        events::Streaks::new(std::time::Duration::from_secs(30)),
        metrics.clone(),
        cancel.clone(),
    ));
    let rec_ago = |secs: i64, action: Action, error: Option<&str>| ActionRecord {
        text: action.to_string(),
        action,
        at: chrono::Utc::now() - chrono::Duration::seconds(secs),
        error: error.map(String::from),
    };
    let rec = |action: Action, error: Option<&str>| rec_ago(0, action, error);
    tx.send(rec(
        Action::AddHook {
            machine: "cp-0".into(),
        },
        None,
    ))
    .unwrap();
    // Failing for 40 s: a Warning.
    for ago in [40, 0] {
        tx.send(rec_ago(
            ago,
            Action::ReleaseHook {
                machine: "cp-0".into(),
            },
            Some("machine backend unavailable"),
        ))
        .unwrap();
    }
    // Failed once, then done (issue 29: "AddLearnerFailed: unhealthy cluster" on every
    // replacement): only the Normal Event, and a transient failure counted.
    let add = || Action::AddLearner {
        machine: "cp-4".into(),
        peer_url: "https://10.0.0.4:2380".into(),
    };
    tx.send(rec(add(), Some("etcdserver: unhealthy cluster")))
        .unwrap();
    tx.send(rec(add(), None)).unwrap();

    let api: Api<Event> = Api::namespaced(client, "openshift-machine-api");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let list = loop {
        let list = api.list(&Default::default()).await.unwrap().items;
        if list.len() >= 3 || std::time::Instant::now() > deadline {
            break list;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let mut got: Vec<(String, String, String)> = list
        .iter()
        .map(|e| {
            (
                e.reason.clone().unwrap_or_default(),
                e.type_.clone().unwrap_or_default(),
                e.regarding
                    .as_ref()
                    .and_then(|r| r.name.clone())
                    .unwrap_or_default(),
            )
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![
            ("DeletionHookAdded".into(), "Normal".into(), "cp-0".into()),
            ("LearnerAdded".into(), "Normal".into(), "cp-4".into()),
            (
                "ReleaseDeletionHookFailed".into(),
                "Warning".into(),
                "cp-0".into()
            ),
        ]
    );
    assert_eq!(metrics.transient("AddLearner"), 1);
    assert_eq!(metrics.transient("ReleaseDeletionHook"), 0);
    assert!(
        list.iter()
            .all(|e| e.reporting_controller.as_deref() == Some("etcd-warden-operator"))
    );
    cancel.cancel();
    task.await.unwrap();
}
