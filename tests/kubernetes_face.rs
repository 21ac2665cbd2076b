//! The sidecar's Kubernetes face (`[kubernetes]`, issue 57): `EtcdSnapshot` objects that follow
//! the store, Events on the pod, and the API never in the way of a snapshot or a hand-off.
//!
//! Real etcd, a real local store and the real binary; the Kubernetes API is the double
//! (tests/support/apiserver.rs), which does NOT check: the CRD's schema (any JSON is stored),
//! RBAC, real server-side apply (an apply is a merge of the applied object here, no field
//! ownership), the Events API's validation (reason and note lengths, series rules).

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_warden::kubernetes::resource::{EtcdSnapshot, OWNER_LABEL};
use etcd_warden::store::{Kind, SnapshotStore};
use kube::api::{Api, ListParams};
use support::apiserver::ApiServer;
use support::dns::DnsServer;
use support::etcd::{EtcdCluster, Release};
use support::pod::Pod;
use support::warden::Warden;
use support::{eventually, finals};

use crate::ownership::{RECORD, US};

const NS: &str = "etcd";
const OWNER: &str = "etcd-main";

fn local_store(root: &std::path::Path) -> (String, SnapshotStore) {
    std::fs::create_dir_all(root).unwrap();
    let store = SnapshotStore::new(
        Arc::new(object_store::local::LocalFileSystem::new_with_prefix(root).unwrap()),
        "",
    );
    (format!("file://{}", root.display()), store)
}

/// `[kubernetes]` for a sidecar reaching the API through `kubeconfig`.
fn face_keys(kubeconfig: &std::path::Path, interval: &str) -> Vec<(&'static str, String)> {
    vec![
        ("kubernetes.namespace", NS.into()),
        ("kubernetes.owner", OWNER.into()),
        ("kubernetes.pod", "etcd-main-0".into()),
        ("kubernetes.pod_uid", "uid-etcd-main-0".into()),
        ("kubernetes.kubeconfig", kubeconfig.display().to_string()),
        ("kubernetes.inventory_interval", interval.into()),
        ("kubernetes.request_timeout", "2s".into()),
    ]
}

/// Every request the sidecar made (the double's log, without the test's own) is one that
/// deploy/components/kubernetes-face/rbac.yaml lets its service account make in its namespace.
fn assert_sidecar_allowed(srv: &ApiServer) {
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy/components/kubernetes-face/rbac.yaml");
    // kustomize puts the objects in the overlay's namespace: here, the test's.
    let text = std::fs::read_to_string(&file).unwrap();
    let mut docs = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let mut v: serde_json::Value = serde::Deserialize::deserialize(doc).unwrap();
        v["metadata"]["namespace"] = NS.into();
        if let Some(subjects) = v["subjects"].as_array_mut() {
            for s in subjects {
                s["namespace"] = NS.into();
            }
        }
        docs.push(serde_yaml::to_string(&v).unwrap());
    }
    let dir = tempfile::tempdir().unwrap();
    let placed = dir.path().join("rbac.yaml");
    std::fs::write(&placed, docs.join("---\n")).unwrap();
    let policy = support::rbac::Policy::load(&[&placed]);
    let made = srv.requests_of("");
    assert!(made.len() > 3, "the sidecar made {} requests", made.len());
    let denied = policy.denied((NS, "etcd-warden-sidecar"), &made);
    assert!(denied.is_empty(), "{} denies {denied:#?}", file.display());
}

async fn objects(api: &Api<EtcdSnapshot>) -> Vec<EtcdSnapshot> {
    api.list(&ListParams::default().labels(&format!("{OWNER_LABEL}={OWNER}")))
        .await
        .map(|l| l.items)
        .unwrap_or_default()
}

fn names_of(objs: &[EtcdSnapshot]) -> Vec<String> {
    let mut n: Vec<String> = objs.iter().map(|o| o.spec.snapshot_name.clone()).collect();
    n.sort();
    n
}

async fn fulls(store: &SnapshotStore) -> Vec<String> {
    let mut n: Vec<String> = store
        .list()
        .await
        .unwrap_or_default()
        .into_iter()
        .filter(|s| s.kind == Kind::Full)
        .map(|s| s.snap_name)
        .collect();
    n.sort();
    n
}

fn stored_condition(o: &EtcdSnapshot) -> (String, String) {
    o.status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.r#type == "Stored"))
        .map(|c| (c.status.clone(), c.reason.clone()))
        .unwrap_or_default()
}

/// One object per full snapshot, its chain following the deltas; retention's deletions delete
/// the object, a snapshot deleted by hand leaves it marked `Vanished`; each object's status is
/// written at most once per interval however often deltas come.
#[tokio::test(flavor = "multi_thread")]
async fn the_inventory_follows_snapshots_retention_and_a_vanished_snapshot() {
    let srv = ApiServer::start().await;
    srv.status_subresource("etcd-warden.io", "etcdsnapshots");
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    srv.write_kubeconfig(&kubeconfig, NS);
    let api: Api<EtcdSnapshot> = Api::namespaced(srv.client_as("test"), NS);
    let etcd = EtcdCluster::single(Release::V35).await;
    let mut client = etcd.client().await;
    let root = dir.path().join("backups");
    let (url, store) = local_store(&root);
    let mut keys = vec![
        ("etcd.endpoints", etcd.endpoints()[0].clone()),
        ("store.url", url),
        ("snapshot.gc_policy", "LimitBased".into()),
        ("snapshot.max_backups", "2".into()),
        ("snapshot.gc_period", "200ms".into()),
        ("snapshot.delta_period", "200ms".into()),
    ];
    keys.extend(face_keys(&kubeconfig, "1s"));
    let w = Warden::start(&keys);
    w.wait_up().await;

    // The first full snapshot (at start) gets its object, kind Scheduled, hash checked on upload.
    let first = eventually(Duration::from_secs(20), || async {
        let want = fulls(&store).await;
        !want.is_empty() && names_of(&objects(&api).await) == want
    })
    .await;
    assert!(
        first,
        "no object for the first full snapshot: {:?}\n{}",
        names_of(&objects(&api).await),
        w.log_text()
    );
    // Its hash was checked as this sidecar stored it (an object the listing found before the
    // actor said it stored it learns that at its next write).
    let checked = eventually(Duration::from_secs(10), || async {
        objects(&api).await[0]
            .status
            .as_ref()
            .is_some_and(|s| s.hash_check == "CheckedOnUpload")
    })
    .await;
    let o = &objects(&api).await[0];
    assert!(checked, "{:?}", o.status);
    assert_eq!(
        o.spec.kind,
        etcd_warden::kubernetes::resource::SnapshotKind::Scheduled
    );
    assert!(
        o.spec.location.starts_with("file://"),
        "{:?}",
        o.spec.location
    );
    assert_eq!(stored_condition(o), ("True".into(), "InStore".into()));

    // Deltas: the chain's last revision follows the writes.
    let mut rev = 0;
    for i in 0..20 {
        rev = client
            .put(format!("k{i}"), "v", None)
            .await
            .unwrap()
            .header()
            .unwrap()
            .revision();
    }
    let followed = eventually(Duration::from_secs(15), || async {
        objects(&api).await.iter().any(|o| {
            o.status
                .as_ref()
                .is_some_and(|s| s.chain.last_revision >= rev && s.chain.deltas > 0)
        })
    })
    .await;
    assert!(
        followed,
        "the chain never reached revision {rev}: {:#?}",
        objects(&api)
            .await
            .iter()
            .map(|o| o.status.clone())
            .collect::<Vec<_>>()
    );

    // Bounded writes: with a delta every 200 ms for 6 s, the object's status is written at most
    // once per second (plus the first): counted at the double.
    let name = objects(&api).await[0].metadata.name.clone().unwrap();
    let status_path = format!("/etcdsnapshots/{name}/status");
    let before = srv
        .requests()
        .iter()
        .filter(|r| r.contains(&status_path))
        .count();
    let window = Instant::now();
    while window.elapsed() < Duration::from_secs(6) {
        client.put("busy", "x", None).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let writes = srv
        .requests()
        .iter()
        .filter(|r| r.contains(&status_path))
        .count()
        - before;
    assert!(
        (1..=8).contains(&writes),
        "{writes} status writes in 6 s at a 1 s interval (deltas every 200 ms)"
    );

    // Requested fulls: retention keeps the newest two of them; the objects follow, and the
    // deleted ones' objects are deleted, not marked.
    let http = reqwest::Client::new();
    let mut taken = Vec::new();
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let r = http.post(w.url("/snapshot/full")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 201, "{}", w.log_text());
        taken.push(
            r.json::<serde_json::Value>().await.unwrap()["snapName"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    let settled = eventually(Duration::from_secs(15), || async {
        let want = fulls(&store).await;
        want.len() == 3 && names_of(&objects(&api).await) == want
    })
    .await;
    assert!(
        settled,
        "objects {:?} != store {:?}\n{}",
        names_of(&objects(&api).await),
        fulls(&store).await,
        w.log_text()
    );
    for gone in &taken[..2] {
        assert!(
            !names_of(&objects(&api).await).contains(gone),
            "{gone}'s object stays after retention deleted it"
        );
    }
    let requested = objects(&api)
        .await
        .into_iter()
        .find(|o| o.spec.snapshot_name == taken[3])
        .unwrap();
    assert_eq!(
        requested.spec.kind,
        etcd_warden::kubernetes::resource::SnapshotKind::Requested
    );

    // A snapshot deleted by hand (retention would have kept it): its object stays, marked.
    let by_hand = &taken[3];
    std::fs::remove_file(root.join("v2").join(by_hand)).unwrap();
    let marked = eventually(Duration::from_secs(15), || async {
        objects(&api).await.iter().any(|o| {
            o.spec.snapshot_name == *by_hand
                && stored_condition(o) == ("False".into(), "Vanished".into())
        })
    })
    .await;
    assert!(
        marked,
        "{by_hand} deleted by hand is not marked Vanished: {:#?}\n{}",
        objects(&api).await,
        w.log_text()
    );
    let (_, metrics) = w.get("/metrics").await.unwrap();
    assert!(
        metrics
            .as_str()
            .unwrap()
            .contains("etcd_warden_kubernetes_inventory_writes_total"),
        "{metrics}"
    );
    assert_sidecar_allowed(&srv);
}

/// Flips the owner record away from a sidecar whose `[kubernetes]` reaches the API through
/// `kubeconfig` and returns, measured from the flip: until `/healthz` is 503, and until the
/// hand-off's final is in the store. Also checks the deltas go on before the flip.
async fn hand_off_with(kubeconfig: &std::path::Path) -> (Duration, Duration, Warden) {
    let dns = DnsServer::start().await;
    dns.set_txt(RECORD, &[US]).await;
    let pod = Pod::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (url, store) = local_store(&dir.path().join("backups"));
    let mut keys = crate::ownership::member_keys(&pod, 0, &dns, &url).await;
    keys.extend(face_keys(kubeconfig, "1s"));
    let w = Warden::start(&keys);
    let active = eventually(Duration::from_secs(20), || async {
        w.get("/healthz").await.map(|(c, _)| c) == Some(200) && !fulls(&store).await.is_empty()
    })
    .await;
    assert!(
        active,
        "never Active with a full snapshot:\n{}",
        w.log_text()
    );
    // Deltas flow while the API is whatever it is.
    let acknowledged = pod.write("before-flip", 20).await;
    let delta = eventually(Duration::from_secs(10), || async {
        store
            .list()
            .await
            .unwrap_or_default()
            .iter()
            .any(|s| s.kind == Kind::Incr && s.last_revision >= acknowledged)
    })
    .await;
    assert!(
        delta,
        "no delta reaching revision {acknowledged}:\n{}",
        w.log_text()
    );
    let flip = Instant::now();
    dns.set_txt(RECORD, &["seed-b"]).await;
    assert!(
        eventually(Duration::from_secs(10), || async {
            w.get("/healthz").await.map(|(c, _)| c) == Some(503)
        })
        .await,
        "never 503:\n{}",
        w.log_text()
    );
    let unready = flip.elapsed();
    let one = eventually(Duration::from_secs(30), || async {
        finals(&store).await.len() == 1
    })
    .await;
    assert!(one, "no final:\n{}", w.log_text());
    let stored = flip.elapsed();
    let fin = &finals(&store).await[0];
    assert!(
        fin.last_revision >= acknowledged,
        "the final misses acknowledged writes"
    );
    drop(dir);
    (unready, stored, w)
}

/// The API that never answers (a listener that accepts and stays silent) delays no snapshot
/// and no hand-off: 503 and the final within the bounds of a sidecar without `[kubernetes]`
/// (ownership tests a and b), measured beside a run with the API answering.
#[tokio::test(flavor = "multi_thread")]
async fn an_api_that_never_answers_delays_no_snapshot_and_no_hand_off() {
    // Connections complete in the kernel's backlog; nothing ever reads them.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let hung = dir.path().join("hung-kubeconfig");
    let srv = ApiServer::start().await;
    srv.write_kubeconfig_via(
        &hung,
        NS,
        &format!("http://{}", silent.local_addr().unwrap()),
    );
    let (unready, stored, w) = hand_off_with(&hung).await;
    println!("API silent: 503 after {unready:?}, final stored after {stored:?}");
    assert!(
        unready <= Duration::from_millis(300) + Duration::from_secs(1),
        "503 after {unready:?}:\n{}",
        w.log_text()
    );
    assert!(
        stored <= Duration::from_secs(20),
        "final after {stored:?}:\n{}",
        w.log_text()
    );
    assert!(
        w.log_text().contains("snapshot inventory: round"),
        "the inventory never said the API failed it:\n{}",
        w.log_text()
    );
    drop(silent);
}

/// A hand-off told on the pod: Deactivated, EtcdKilled, Fenced and FinalSnapshotStored Events
/// with the pod's name and UID; the snapshot leader's first full snapshot has its object.
#[tokio::test(flavor = "multi_thread")]
async fn a_hand_off_is_told_in_events_on_the_pod() {
    let srv = ApiServer::start().await;
    srv.status_subresource("etcd-warden.io", "etcdsnapshots");
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    srv.write_kubeconfig(&kubeconfig, NS);
    let (unready, stored, w) = hand_off_with(&kubeconfig).await;
    println!("API answering: 503 after {unready:?}, final stored after {stored:?}");
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(srv.client_as("test"), NS);
    let want = [
        "OwnershipConfirmed",
        "Deactivated",
        "EtcdKilled",
        "Fenced",
        "FinalSnapshotStored",
    ];
    let told = eventually(Duration::from_secs(15), || async {
        let got: Vec<String> = events
            .list(&ListParams::default())
            .await
            .map(|l| l.items.into_iter().filter_map(|e| e.reason).collect())
            .unwrap_or_default();
        want.iter().all(|r| got.iter().any(|g| g == r))
    })
    .await;
    let all = events.list(&ListParams::default()).await.unwrap().items;
    assert!(
        told,
        "events {:?}, want {want:?}\n{}",
        all.iter().map(|e| e.reason.clone()).collect::<Vec<_>>(),
        w.log_text()
    );
    for e in &all {
        let about = e.regarding.as_ref().unwrap();
        assert_eq!(
            (
                about.kind.as_deref(),
                about.name.as_deref(),
                about.uid.as_deref()
            ),
            (Some("Pod"), Some("etcd-main-0"), Some("uid-etcd-main-0")),
            "{e:?}"
        );
        assert_eq!(e.reporting_controller.as_deref(), Some("etcd-warden"));
    }
    let fin = all
        .iter()
        .find(|e| e.reason.as_deref() == Some("FinalSnapshotStored"))
        .unwrap();
    assert!(
        fin.note.as_deref().unwrap_or_default().contains(".final"),
        "{fin:?}"
    );
    // The final has its object too (the sidecar stored it).
    let api: Api<EtcdSnapshot> = Api::namespaced(srv.client_as("test"), NS);
    let final_object = eventually(Duration::from_secs(10), || async {
        objects(&api).await.iter().any(|o| {
            o.spec.snapshot_name.ends_with(".final")
                && o.spec.kind == etcd_warden::kubernetes::resource::SnapshotKind::Final
        })
    })
    .await;
    assert!(
        final_object,
        "no object for the final: {:?}",
        names_of(&objects(&api).await)
    );
    assert_sidecar_allowed(&srv);
}

/// A Job's one Event on its pod: the copy Job done, and failed with its error.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_tells_how_it_ended_on_its_pod() {
    let srv = ApiServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    srv.write_kubeconfig(&kubeconfig, NS);
    let (dst, _) = local_store(&dir.path().join("dst"));
    let copy = |source: String| {
        let mut c = support::warden::command();
        c.args(["copy", "--source-store", &source, "--dest-store", &dst]);
        for (k, v) in face_keys(&kubeconfig, "30s") {
            c.env(etcd_warden::config::env_var_for(k), v);
        }
        c.output().unwrap()
    };
    // Nothing to copy: done.
    let (empty, _) = local_store(&dir.path().join("empty"));
    let ok = copy(empty);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    // A source whose one snapshot is not what its name says: the copy fails, naming it.
    let (src, _) = local_store(&dir.path().join("src"));
    std::fs::create_dir_all(dir.path().join("src/v2")).unwrap();
    std::fs::write(
        dir.path()
            .join("src/v2/Full-00000000-00000001-1700000000.gz"),
        b"no gzip",
    )
    .unwrap();
    let failed = copy(src);
    assert!(
        !failed.status.success(),
        "{}",
        String::from_utf8_lossy(&failed.stderr)
    );
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(srv.client_as("test"), NS);
    let all = events.list(&ListParams::default()).await.unwrap().items;
    let reasons: Vec<_> = all.iter().filter_map(|e| e.reason.clone()).collect();
    assert_eq!(reasons, ["CopyCompleted", "CopyFailed"], "{all:#?}");
    let failed_event = &all[1];
    assert_eq!(failed_event.type_.as_deref(), Some("Warning"));
    assert_eq!(
        failed_event.reporting_controller.as_deref(),
        Some("etcd-warden-copy")
    );
    assert_eq!(
        failed_event
            .regarding
            .as_ref()
            .and_then(|r| r.name.as_deref()),
        Some("etcd-main-0")
    );
    assert!(
        failed_event
            .note
            .as_deref()
            .unwrap_or_default()
            .contains("copy failed"),
        "{failed_event:?}"
    );
}
