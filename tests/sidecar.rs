//! `etcd-warden serve` against real etcd and a real S3 server: snapshots appear with the right
//! names and revisions, every payload verifies and holds exactly the writes, the HTTP API answers
//! as specified, and in a multi-member cluster only the leader's sidecar snapshots.

use crate::support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use etcd_warden::snapshot::delta::{self, EventType};
use etcd_warden::snapshot::verify::verify;
use etcd_warden::store::{Kind, Snapshot, SnapshotStore};
use serde_json::Value;
use support::cli::succeeds;
use support::etcd::{EtcdCluster, Release};
use support::eventually;
use support::s3::S3Server;
use support::warden::{Warden, command};

/// Puts, overwrites, deletes and a large value; returns the revision after them.
async fn workload(client: &mut etcd_client::Client, tag: &str) -> i64 {
    for i in 0..30 {
        client
            .put(format!("/{tag}/key{i:02}"), format!("value-{i}"), None)
            .await
            .unwrap();
    }
    client
        .put(format!("/{tag}/key00"), "overwritten", None)
        .await
        .unwrap();
    client.delete(format!("/{tag}/key01"), None).await.unwrap();
    client
        .put(format!("/{tag}/large"), vec![b'x'; 200 * 1024], None)
        .await
        .unwrap();
    support::etcd::revision(client, "/").await
}

fn store_keys(
    s3: &S3Server,
    bucket: &str,
    prefix: &str,
    etcd: &EtcdCluster,
) -> Vec<(&'static str, String)> {
    let mut keys: Vec<(&'static str, String)> = s3
        .config_overrides("store", bucket, prefix)
        .into_iter()
        .map(|(k, v)| {
            (
                if k.ends_with(".url") {
                    "store.url"
                } else {
                    leak(k)
                },
                v,
            )
        })
        .collect();
    keys.push(("etcd.endpoints", etcd.endpoints()[0].clone()));
    keys
}

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

async fn latest(w: &Warden) -> Value {
    w.get("/snapshot/latest")
        .await
        .map(|(_, v)| v)
        .unwrap_or(Value::Null)
}

/// Checks that the deltas continue the full snapshot without gaps and end at `revision`.
fn assert_chain(list: &[Snapshot], revision: i64) {
    let full = list
        .iter()
        .rposition(|s| s.kind == Kind::Full)
        .expect("a full snapshot");
    let mut last = list[full].last_revision;
    for d in &list[full + 1..] {
        assert_eq!(d.kind, Kind::Incr, "{list:?}");
        assert_eq!(d.start_revision, last + 1, "gap before {}", d.snap_name);
        last = d.last_revision;
    }
    assert_eq!(
        last, revision,
        "the chain ends at etcd's revision: {list:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn snapshots_flow_to_s3_with_verified_payloads_and_the_api_answers() {
    let s3 = S3Server::start(&["backups"]);
    let etcd = EtcdCluster::single(Release::V35).await;
    let mut client = etcd.client().await;
    let before = workload(&mut client, "before").await;

    let mut keys = store_keys(&s3, "backups", "shoot--a/etcd-main", &etcd);
    keys.push(("snapshot.delta_period", "300ms".into()));
    keys.push(("server.token", "t0ken".into()));
    let mut w = Warden::start(&keys);
    w.wait_up().await;

    // A full snapshot at start, covering the writes so far.
    let full_seen = eventually(Duration::from_secs(20), || async {
        latest(&w).await["fullSnapshot"]["lastRevision"].as_i64() >= Some(before)
    })
    .await;
    assert!(full_seen, "no full snapshot; log:\n{}", w.log_text());

    // Later writes arrive as deltas.
    let after = workload(&mut client, "after").await;
    let deltas_seen = eventually(Duration::from_secs(20), || async {
        latest(&w).await["deltaSnapshots"]
            .as_array()
            .and_then(|d| d.last())
            .and_then(|d| d["lastRevision"].as_i64())
            == Some(after)
    })
    .await;
    assert!(
        deltas_seen,
        "deltas did not reach revision {after}: {}; log:\n{}",
        latest(&w).await,
        w.log_text()
    );

    // The store, read directly: names parse, the chain has no gap, every payload verifies, and
    // the deltas hold exactly the later writes.
    let store = SnapshotStore::new(s3.object_store("backups"), "shoot--a/etcd-main");
    let list = store.list().await.unwrap();
    assert_chain(&list, after);
    let mut events = Vec::new();
    for s in &list {
        assert!(s.key().starts_with("shoot--a/etcd-main/v2/"), "{}", s.key());
        assert!(
            s.snap_name.ends_with(".gz"),
            "gzip by default: {}",
            s.snap_name
        );
        verify(&store, s).await.unwrap_or_else(|e| panic!("{e}"));
        if s.kind == Kind::Incr {
            events.extend(delta::read(&store, s).await.unwrap());
        }
    }
    let full_rev = list
        .iter()
        .rfind(|s| s.kind == Kind::Full)
        .unwrap()
        .last_revision;
    let expected: Vec<_> = events
        .iter()
        .filter(|e| e.event.revision() > full_rev)
        .collect();
    assert_eq!(
        expected.len() as i64,
        after - full_rev,
        "one event per revision"
    );
    let last_put = expected
        .iter()
        .find(|e| e.event.kv.as_ref().unwrap().key == b"/after/large")
        .unwrap();
    assert_eq!(last_put.event.kv.as_ref().unwrap().value.len(), 200 * 1024);
    assert!(expected.iter().any(|e| e.event.kind == EventType::Delete
        && e.event.kv.as_ref().unwrap().key == b"/after/key01"));

    // HTTP API.
    let (code, body) = w.get("/healthz").await.unwrap();
    assert_eq!((code, body["ready"].as_bool()), (200, Some(true)), "{body}");
    let (code, status) = w.get("/status").await.unwrap();
    assert_eq!(code, 200);
    assert_eq!(status["snapshotter"]["leader"], true, "{status}");
    let (_, metrics) = w.get("/metrics").await.unwrap();
    let metrics = metrics.as_str().unwrap().to_string();
    assert!(
        metrics.contains(&format!(
            "etcdbr_snapshot_latest_revision{{kind=\"Incr\"}} {after}"
        )),
        "{metrics}"
    );
    assert!(
        metrics
            .contains("etcdbr_snapshot_duration_seconds_count{kind=\"Full\",succeeded=\"true\"}"),
        "{metrics}"
    );

    let http = reqwest::Client::new();
    let r = http.post(w.url("/snapshot/full")).send().await.unwrap();
    assert_eq!(
        r.status().as_u16(),
        401,
        "mutating endpoints need the token"
    );
    let post = |path: &str| http.post(w.url(path)).bearer_auth("t0ken").send();
    // A final snapshot belongs to a hand-off: refused while the sidecar serves etcd.
    let r = post("/snapshot/full?final=true").await.unwrap();
    assert_eq!(r.status().as_u16(), 409);
    let refusal: Value = r.json().await.unwrap();
    assert_eq!(refusal["code"], "not_deactivated", "{refusal}");
    let r = post("/snapshot/full").await.unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let snap: Value = r.json().await.unwrap();
    assert_eq!(snap["isFinal"], false);
    assert!(
        snap["snapName"].as_str().unwrap().ends_with(".gz"),
        "{snap}"
    );
    let (_, l) = w.get("/snapshot/latest").await.unwrap();
    assert_eq!(l["fullSnapshot"]["snapName"], snap["snapName"], "{l}");

    // The ops commands see the same store.
    let url = "s3://backups/shoot--a/etcd-main".to_string();
    let s3_env = s3.env("store");
    let out = succeeds(
        command()
            .args(["ls", "--json", "--store", &url])
            .envs(s3_env.clone()),
    );
    let listed: Vec<Snapshot> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed.len(), list.len() + 1);
    succeeds(command().args(["verify", "--store", &url]).envs(s3_env));

    // SIGTERM: a clean, prompt exit.
    let status = w
        .terminate(Duration::from_secs(10))
        .expect("exits on SIGTERM");
    assert!(status.success(), "{status:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn etcd_34_snapshots_to_a_local_directory_and_the_snapshot_command() {
    let etcd = EtcdCluster::single(Release::V34).await;
    let mut client = etcd.client().await;
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}/backups", dir.path().display());
    let rev = workload(&mut client, "v34").await;
    let out = succeeds(
        command()
            .args(["snapshot", "--final"])
            .env("ETCD_WARDEN_STORE_URL", &url)
            .env("ETCD_WARDEN_ETCD_ENDPOINTS", etcd.endpoints()[0].clone()),
    );
    let name = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        name.starts_with(&format!("Full-00000000-{rev:08}-")) && name.ends_with(".gz.final"),
        "{name}"
    );
    succeeds(command().args(["verify", "--store", &url]));
    // A corrupted payload is caught by verify: one byte of the database flipped, then
    // recompressed (gzip's own CRC then agrees, so only the snapshot's SHA-256 can tell).
    let path = dir.path().join("backups/v2").join(&name);
    let mut db = Vec::new();
    std::io::Read::read_to_end(
        &mut flate2::read::MultiGzDecoder::new(std::fs::File::open(&path).unwrap()),
        &mut db,
    )
    .unwrap();
    let mid = db.len() / 2;
    db[mid] ^= 0xff;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, &db).unwrap();
    std::fs::write(&path, gz.finish().unwrap()).unwrap();
    let out = command()
        .args(["verify", "--store", &url])
        .output()
        .unwrap();
    let said = support::cli::printed(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains(&format!("FAIL  {name}")), "{said}");
}

#[tokio::test(flavor = "multi_thread")]
async fn only_the_leaders_sidecar_snapshots_and_another_takes_over_without_a_gap() {
    let mut etcd = EtcdCluster::start(3, Release::V35).await;
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}/backups", dir.path().display());
    let wardens: Vec<Warden> = etcd
        .members
        .iter()
        .map(|m| {
            Warden::start(&[
                ("store.url", url.clone()),
                ("etcd.endpoints", m.client_url()),
                ("snapshot.delta_period", "300ms".into()),
            ])
        })
        .collect();
    for w in &wardens {
        w.wait_up().await;
    }
    let leader_index = || crate::support::warden::snapshot_leaders(&wardens);
    assert!(
        eventually(Duration::from_secs(10), || async {
            leader_index().await.len() == 1
        })
        .await
    );
    let first = leader_index().await[0];

    let mut client = etcd.client().await;
    let rev = workload(&mut client, "one").await;
    let store = SnapshotStore::from_config(
        &etcd_warden::config::Config::load(&etcd_warden::config::Sources {
            file: None,
            env: &std::collections::HashMap::from([(
                "ETCD_WARDEN_STORE_URL".to_string(),
                url.clone(),
            )]),
            overrides: vec![],
        })
        .unwrap()
        .0
        .store,
    )
    .unwrap();
    let reached = |r: i64| support::stored::newest_at(store.clone(), r);
    assert!(
        eventually(Duration::from_secs(15), || reached(rev)).await,
        "first leader's snapshots reach {rev}"
    );
    for (i, w) in wardens.iter().enumerate() {
        let log = w.log_text();
        assert_eq!(
            log.contains("full snapshot stored"),
            i == first,
            "sidecar {i} (leader {first}):\n{log}"
        );
    }

    // The leader's etcd dies: another member leads, and its sidecar continues the chain.
    etcd.members[first].kill();
    let survivors: Vec<String> = etcd
        .members
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != first)
        .map(|(_, m)| m.client_url())
        .collect();
    let mut client = etcd_client::Client::connect(survivors, None).await.unwrap();
    let mut rev = 0;
    for attempt in 0..50 {
        match client.put(format!("/two/key{attempt}"), "v", None).await {
            Ok(r) => rev = r.header().unwrap().revision(),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    assert!(
        eventually(Duration::from_secs(20), || reached(rev)).await,
        "the new leader's sidecar reaches {rev}; store: {:?}",
        store.list().await
    );
    assert_chain(&store.list().await.unwrap(), rev);
    let now_leading = leader_index().await;
    assert_eq!(now_leading.len(), 1);
    assert_ne!(now_leading[0], first);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_api_serves_https_with_the_configured_certificate() {
    let etcd = EtcdCluster::single(Release::V35).await;
    let certs = tempfile::tempdir().unwrap();
    support::tls::make_certs(certs.path());
    let store = tempfile::tempdir().unwrap();
    let w = Warden::start(&[
        ("etcd.endpoints", etcd.endpoints()[0].clone()),
        ("store.url", format!("file://{}", store.path().display())),
        (
            "server.tls_cert_file",
            certs.path().join("server.pem").display().to_string(),
        ),
        (
            "server.tls_key_file",
            certs.path().join("server.key").display().to_string(),
        ),
    ]);
    let curl = |scheme: &str, path: &str| {
        std::process::Command::new("curl")
            .args(["-sS", "--max-time", "2", "--cacert"])
            .arg(certs.path().join("ca.pem"))
            .arg(format!("{scheme}://127.0.0.1:{}{path}", w.port))
            .output()
            .expect("curl (apt-get install curl)")
    };
    let up = eventually(Duration::from_secs(20), || async {
        curl("https", "/livez").status.success()
    })
    .await;
    assert!(up, "no HTTPS answer; log:\n{}", w.log_text());
    let out = curl("https", "/healthz");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("\"ready\""),
        "{out:?}"
    );
    assert!(
        !curl("http", "/livez").status.success(),
        "plain HTTP must not be served"
    );
}

/// A rotated certificate is served without a restart; a half-written pair (the key replaced
/// before the certificate) does not stop the server.
#[tokio::test(flavor = "multi_thread")]
async fn the_https_certificate_is_reloaded_when_its_files_change() {
    let (old, new, live) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    support::tls::make_certs(old.path());
    support::tls::make_certs(new.path());
    let install = |from: &Path, file: &str| {
        // Write beside and rename, as a Secret volume update does.
        let tmp = live.path().join(format!(".{file}.tmp"));
        std::fs::copy(from.join(file), &tmp).unwrap();
        std::fs::rename(&tmp, live.path().join(file)).unwrap();
    };
    install(old.path(), "server.key");
    install(old.path(), "server.pem");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let router = axum::Router::new().route("/livez", axum::routing::get(|| async { "ok" }));
    let cancel = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(etcd_warden::server::serve_tls_checking(
        listener,
        router,
        cancel.clone(),
        etcd_warden::server::ServerTls {
            cert: live.path().join("server.pem"),
            key: live.path().join("server.key"),
            client_ca: None,
        },
        Duration::from_millis(100),
    ));
    let trusted_by = |ca: &Path| {
        let ca = ca.join("ca.pem");
        async move {
            std::process::Command::new("curl")
                .args(["-sS", "--max-time", "2", "--cacert"])
                .arg(ca)
                .arg(format!("https://127.0.0.1:{port}/livez"))
                .output()
                .expect("curl (apt-get install curl)")
                .status
                .success()
        }
    };
    assert!(eventually(Duration::from_secs(10), || trusted_by(old.path())).await);
    assert!(!trusted_by(new.path()).await);
    install(new.path(), "server.key");
    tokio::time::sleep(Duration::from_millis(300)).await;
    install(new.path(), "server.pem");
    assert!(
        eventually(Duration::from_secs(10), || trusted_by(new.path())).await,
        "the new certificate is never served"
    );
    assert!(
        !trusted_by(old.path()).await,
        "the old certificate is still served"
    );
    cancel.cancel();
    server.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn retention_runs_in_the_sidecar_and_keeps_the_newest_full_snapshots() {
    let etcd = EtcdCluster::single(Release::V35).await;
    let mut client = etcd.client().await;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("backups");
    let w = Warden::start(&[
        ("etcd.endpoints", etcd.endpoints()[0].clone()),
        ("store.url", format!("file://{}", root.display())),
        ("snapshot.gc_policy", "LimitBased".into()),
        ("snapshot.max_backups", "2".into()),
        ("snapshot.gc_period", "200ms".into()),
        ("snapshot.delta_period", "0s".into()),
    ]);
    w.wait_up().await;
    std::fs::create_dir_all(&root).unwrap();
    let store = SnapshotStore::new(
        Arc::new(object_store::local::LocalFileSystem::new_with_prefix(&root).unwrap()),
        "",
    );
    // The full snapshot the sidecar takes on its own at start (nothing in the store): scheduled.
    let names = || async {
        let list = store.list().await.unwrap();
        list.into_iter().map(|s| s.snap_name).collect::<Vec<_>>()
    };
    assert!(
        eventually(Duration::from_secs(10), || async {
            !names().await.is_empty()
        })
        .await,
        "no first full snapshot\n{}",
        w.log_text()
    );
    let scheduled = names().await;
    let http = reqwest::Client::new();
    let mut taken = Vec::new();
    for i in 0..4 {
        client.put(format!("/gc/{i}"), "v", None).await.unwrap();
        // Names carry whole seconds: one full snapshot per second keeps them distinct.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let r = http.post(w.url("/snapshot/full")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 201, "{}", w.log_text());
        taken.push(r.json::<Snapshot>().await.unwrap().snap_name);
    }
    // Requested fulls (issue 45, item 5: anyone may request them under etcd-druid) are counted
    // apart: the newest max_backups of them are kept, and they never push the scheduled one out.
    let want: Vec<String> = scheduled.iter().chain(&taken[2..]).cloned().collect();
    assert!(
        eventually(Duration::from_secs(10), || async { names().await == want }).await,
        "retention should keep only {want:?}: {:?}",
        names().await
    );
    let (_, metrics) = w.get("/metrics").await.unwrap();
    assert!(
        metrics
            .as_str()
            .unwrap()
            .contains("etcdbr_snapshot_gc_total{kind=\"Full\",succeeded=\"true\"} "),
        "{metrics}"
    );
}

/// Issue 54, item 6: `/snapshot/latest` keeps its listing for a delta period (here an hour), so
/// what another process stores is not seen at once; what this sidecar stores is, in the next
/// answer.
#[tokio::test(flavor = "multi_thread")]
async fn latest_is_kept_a_delta_period_and_names_a_snapshot_this_sidecar_stores_at_once() {
    let etcd = EtcdCluster::single(Release::V35).await;
    let mut client = etcd.client().await;
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}/backups", dir.path().display());
    workload(&mut client, "before").await;
    let w = Warden::start(&[
        ("store.url", url.clone()),
        ("etcd.endpoints", etcd.endpoints()[0].clone()),
        ("snapshot.delta_period", "1h".into()),
    ]);
    w.wait_up().await;
    // The first full snapshot, stored by this sidecar after whatever answer was kept before.
    let full_seen = eventually(Duration::from_secs(20), || async {
        latest(&w).await["fullSnapshot"]["snapName"].is_string()
    })
    .await;
    assert!(full_seen, "no full snapshot; log:\n{}", w.log_text());
    let kept = latest(&w).await["fullSnapshot"]["snapName"].clone();

    // Another process stores a newer full snapshot: the kept answer stands.
    workload(&mut client, "other").await;
    let out = succeeds(
        command()
            .args(["snapshot"])
            .env("ETCD_WARDEN_STORE_URL", &url)
            .env("ETCD_WARDEN_ETCD_ENDPOINTS", etcd.endpoints()[0].clone()),
    );
    let other = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(other.starts_with("Full-"), "{other}");
    assert_eq!(latest(&w).await["fullSnapshot"]["snapName"], kept);

    // This sidecar stores one: the next answer names it.
    workload(&mut client, "ours").await;
    let r = reqwest::Client::new()
        .post(w.url("/snapshot/full"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let ours: Value = r.json().await.unwrap();
    assert_eq!(
        latest(&w).await["fullSnapshot"]["snapName"],
        ours["snapName"],
        "log:\n{}",
        w.log_text()
    );
}
