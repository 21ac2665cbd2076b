//! The ownership protocol end to end with real processes: the DNS server answers the owner TXT
//! record, a real etcd runs under a "kubelet" that restarts it when it dies, `etcd-warden serve`
//! runs as a child process, and snapshots go to a real S3 server or a local directory.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_warden::store::{Kind, Snapshot, SnapshotStore};
use support::dns::{DnsServer, Mode};
use support::etcd::{EtcdCluster, Release};
use support::eventually;
use support::pod::Pod;
use support::s3::S3Server;
use support::warden::Warden;

const RECORD: &str = "owner.shoot.warden.test";
const US: &str = "seed-a";
const THEM: &str = "seed-b";
/// The check interval the sidecars run with.
const INTERVAL: Duration = Duration::from_millis(300);

/// The sidecar's configuration for `pod`, owner record on `dns`, snapshots to `store_url`.
async fn sidecar_keys(pod: &Pod, dns: &DnsServer, store_url: &str) -> Vec<(&'static str, String)> {
    member_keys(pod, 0, dns, store_url).await
}

/// The configuration of the sidecar next to member `i` of `pod`.
async fn member_keys(
    pod: &Pod,
    i: usize,
    dns: &DnsServer,
    store_url: &str,
) -> Vec<(&'static str, String)> {
    let (endpoint, data_dir) = {
        let c = pod.etcd.lock().await;
        (
            c.members[i].client_url(),
            c.members[i].data_dir.display().to_string(),
        )
    };
    vec![
        ("etcd.endpoints", endpoint),
        ("store.url", store_url.to_string()),
        ("snapshot.delta_period", "300ms".into()),
        ("owner.name", RECORD.into()),
        ("owner.id", US.into()),
        ("owner.interval", "300ms".into()),
        ("owner.timeout", "300ms".into()),
        ("owner.failure_threshold", "2".into()),
        // The fixture's records say TTL 60 s; trust none of them, so a flip is seen at the next check.
        ("owner.ttl_cap", "0s".into()),
        ("owner.nameservers", dns.addr().to_string()),
        ("kill.process_name", "etcd".into()),
        // Only this test's etcd: others run beside it on the machine.
        ("kill.cmdline_contains", data_dir),
        ("kill.grace", "3s".into()),
    ]
}

async fn healthz(w: &Warden) -> u16 {
    w.get("/healthz").await.map(|(c, _)| c).unwrap_or(0)
}

async fn finals(store: &SnapshotStore) -> Vec<Snapshot> {
    store
        .list()
        .await
        .unwrap_or_default()
        .into_iter()
        .filter(|s| s.kind == Kind::Full && s.is_final)
        .collect()
}

fn file_store(dir: &tempfile::TempDir) -> (String, SnapshotStore) {
    let root = dir.path().join("backups");
    std::fs::create_dir_all(&root).unwrap();
    let url = format!("file://{}", root.display());
    let store = SnapshotStore::new(
        Arc::new(object_store::local::LocalFileSystem::new_with_prefix(&root).unwrap()),
        "",
    );
    (url, store)
}

/// Waits for Active (200) with at least one regular full snapshot stored.
async fn until_active(w: &Warden, store: &SnapshotStore) {
    let ok = eventually(Duration::from_secs(20), || async {
        healthz(w).await == 200
            && store
                .list()
                .await
                .map(|l| l.iter().any(|s| s.kind == Kind::Full))
                .unwrap_or(false)
    })
    .await;
    assert!(
        ok,
        "sidecar never became Active with a snapshot; log:\n{}",
        w.log_text()
    );
}

/// Measures how long after `flip` the sidecar answers 503.
async fn time_to_503(w: &Warden, since: Instant) -> Duration {
    assert!(
        eventually(Duration::from_secs(10), || async {
            healthz(w).await == 503
        })
        .await,
        "never 503:\n{}",
        w.log_text()
    );
    since.elapsed()
}

/// Scenario a (and b with `delete`): the record names another owner, or disappears.
async fn losing_ownership(delete: bool) {
    let dns = DnsServer::start().await;
    dns.set_txt(RECORD, &[US]).await;
    let pod = Pod::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (url, store) = file_store(&dir);
    let w = Warden::start(&sidecar_keys(&pod, &dns, &url).await);
    until_active(&w, &store).await;

    let acknowledged = pod.write("before-flip", 20).await;
    let flip = Instant::now();
    if delete {
        dns.remove_txt(RECORD).await;
    } else {
        dns.set_txt(RECORD, &[THEM]).await;
    }
    let latency = time_to_503(&w, flip).await;
    assert!(
        latency <= INTERVAL + Duration::from_secs(1),
        "503 after {latency:?}"
    );

    assert!(
        eventually(Duration::from_secs(15), || async { pod.deaths() >= 1 }).await,
        "etcd was not killed:\n{}",
        w.log_text()
    );
    assert!(
        eventually(Duration::from_secs(20), || async {
            finals(&store).await.len() == 1
        })
        .await,
        "no final snapshot:\n{}",
        w.log_text()
    );
    let fin = &finals(&store).await[0];
    assert!(
        fin.last_revision >= acknowledged,
        "final at {} misses writes up to {acknowledged}",
        fin.last_revision
    );
    assert!(fin.snap_name.ends_with(".final"), "{}", fin.snap_name);
    let (_, latest) = w.get("/snapshot/latest").await.unwrap();
    assert_eq!(latest["fullSnapshot"]["isFinal"], true, "{latest}");

    // Sticky: later verdicts change nothing, and no second final snapshot appears.
    dns.set_txt(RECORD, &[US]).await;
    tokio::time::sleep(INTERVAL * 5).await;
    assert_eq!(healthz(&w).await, 503, "Deactivated is sticky");
    assert_eq!(finals(&store).await.len(), 1);
    let (_, status) = w.get("/status").await.unwrap();
    assert_eq!(status["owner"]["state"], "deactivated", "{status}");
    // Regular snapshots stopped: nothing newer than the final.
    let list = store.list().await.unwrap();
    assert_eq!(list.last().map(|s| s.is_final), Some(true), "{list:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_record_naming_another_owner_deactivates_with_exactly_one_final_snapshot() {
    losing_ownership(false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn b_a_deleted_record_deactivates_with_exactly_one_final_snapshot() {
    losing_ownership(true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn c_unresolvable_suspends_without_final_then_resumes_or_deactivates() {
    let dns = DnsServer::start().await;
    dns.set_txt(RECORD, &[US]).await;
    let pod = Pod::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (url, store) = file_store(&dir);
    let w = Warden::start(&sidecar_keys(&pod, &dns, &url).await);
    until_active(&w, &store).await;

    dns.stop().await;
    time_to_503(&w, Instant::now()).await;
    assert!(
        eventually(Duration::from_secs(15), || async { pod.deaths() >= 1 }).await,
        "etcd was not killed:\n{}",
        w.log_text()
    );
    tokio::time::sleep(INTERVAL * 4).await;
    assert!(
        finals(&store).await.is_empty(),
        "no final snapshot while unresolvable"
    );
    let (_, status) = w.get("/status").await.unwrap();
    assert_eq!(status["owner"]["state"], "suspended", "{status}");

    // Back with our ID: ready again, and regular snapshots resume.
    dns.restart().await;
    assert!(
        eventually(Duration::from_secs(15), || async {
            healthz(&w).await == 200
        })
        .await,
        "not Active again:\n{}",
        w.log_text()
    );
    let rev = pod.write("after-resume", 5).await;
    let resumed = eventually(Duration::from_secs(15), || async {
        store
            .list()
            .await
            .map(|l| l.last().map(|s| s.last_revision) >= Some(rev))
            .unwrap_or(false)
    })
    .await;
    assert!(
        resumed,
        "regular snapshots did not resume:\n{}",
        w.log_text()
    );
    assert!(finals(&store).await.is_empty());

    // Unresolvable again, then back naming another owner: the final snapshot now.
    dns.set_mode(Mode::ServFail);
    time_to_503(&w, Instant::now()).await;
    dns.set_txt(RECORD, &[THEM]).await;
    dns.set_mode(Mode::Normal);
    assert!(
        eventually(Duration::from_secs(20), || async {
            finals(&store).await.len() == 1
        })
        .await,
        "no final:\n{}",
        w.log_text()
    );
    tokio::time::sleep(INTERVAL * 3).await;
    assert_eq!(finals(&store).await.len(), 1);
    assert_eq!(healthz(&w).await, 503);
}

#[tokio::test(flavor = "multi_thread")]
async fn d_store_down_at_the_flip_final_snapshot_once_it_is_back() {
    let mut s3 = S3Server::start(&["backups"]);
    let dns = DnsServer::start().await;
    dns.set_txt(RECORD, &[US]).await;
    let pod = Pod::start().await;
    let mut keys = sidecar_keys(&pod, &dns, "s3://backups/etcd").await;
    keys.retain(|(k, _)| *k != "store.url");
    for (k, v) in s3.config_overrides("store", "backups", "etcd") {
        keys.push((Box::leak(k.into_boxed_str()), v));
    }
    let store = SnapshotStore::new(s3.object_store("backups"), "etcd");
    let w = Warden::start(&keys);
    until_active(&w, &store).await;
    let acknowledged = pod.write("before-outage", 10).await;

    s3.stop();
    dns.set_txt(RECORD, &[THEM]).await;
    time_to_503(&w, Instant::now()).await;
    assert!(
        eventually(Duration::from_secs(15), || async { pod.deaths() >= 1 }).await,
        "etcd was not killed:\n{}",
        w.log_text()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        healthz(&w).await,
        503,
        "unready while the final snapshot cannot be stored"
    );

    s3.resume();
    assert!(
        eventually(Duration::from_secs(30), || async {
            finals(&store).await.len() == 1
        })
        .await,
        "no final after S3 came back:\n{}",
        w.log_text()
    );
    assert!(finals(&store).await[0].last_revision >= acknowledged);
    tokio::time::sleep(INTERVAL * 3).await;
    assert_eq!(finals(&store).await.len(), 1, "exactly one");
}

#[tokio::test(flavor = "multi_thread")]
async fn e_a_restarted_sidecar_takes_no_second_final_snapshot() {
    let dns = DnsServer::start().await;
    dns.set_txt(RECORD, &[US]).await;
    let pod = Pod::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (url, store) = file_store(&dir);
    let mut w = Warden::start(&sidecar_keys(&pod, &dns, &url).await);
    until_active(&w, &store).await;
    dns.set_txt(RECORD, &[THEM]).await;
    assert!(
        eventually(Duration::from_secs(20), || async {
            finals(&store).await.len() == 1
        })
        .await,
        "no final:\n{}",
        w.log_text()
    );

    w.restart();
    w.wait_up().await;
    tokio::time::sleep(INTERVAL * 6).await;
    assert_eq!(healthz(&w).await, 503, "still unready after a restart");
    assert_eq!(
        finals(&store).await.len(),
        1,
        "no second final snapshot:\n{}",
        w.log_text()
    );
    let (_, status) = w.get("/status").await.unwrap();
    assert_eq!(status["owner"]["state"], "deactivated", "{status}");
}

#[tokio::test(flavor = "multi_thread")]
async fn every_member_of_a_cluster_deactivates_but_only_one_final_snapshot_is_taken() {
    let dns = DnsServer::start().await;
    dns.set_txt(RECORD, &[US]).await;
    let pod = Pod::cluster(3).await;
    let dir = tempfile::tempdir().unwrap();
    let (url, store) = file_store(&dir);
    let mut wardens = Vec::new();
    for i in 0..3 {
        wardens.push(Warden::start(&member_keys(&pod, i, &dns, &url).await));
    }
    for w in &wardens {
        until_active(w, &store).await;
    }
    let acknowledged = pod.write("cluster", 10).await;

    dns.set_txt(RECORD, &[THEM]).await;
    for w in &wardens {
        time_to_503(w, Instant::now()).await;
    }
    assert!(
        eventually(Duration::from_secs(20), || async { pod.deaths() >= 3 }).await,
        "every member is killed (deaths {})",
        pod.deaths()
    );
    let one = eventually(Duration::from_secs(30), || async {
        finals(&store).await.len() == 1
    })
    .await;
    let logs = || {
        wardens
            .iter()
            .map(Warden::log_text)
            .collect::<Vec<_>>()
            .join("\n-----\n")
    };
    assert!(one, "no final snapshot:\n{}", logs());
    // Every sidecar sees its deactivation through: the final snapshot is done for all of them.
    let all_done = eventually(Duration::from_secs(15), || async {
        let mut done = 0;
        for w in &wardens {
            if let Some((_, s)) = w.get("/status").await
                && s["owner"]["finalSnapshot"].is_string()
            {
                done += 1;
            }
        }
        done == 3
    })
    .await;
    assert!(
        all_done,
        "every sidecar settles on the one final snapshot:\n{}",
        logs()
    );
    tokio::time::sleep(INTERVAL * 4).await;
    let f = finals(&store).await;
    assert_eq!(
        f.len(),
        1,
        "exactly one final snapshot for the cluster: {f:?}"
    );
    assert!(f[0].last_revision >= acknowledged);
    for w in &wardens {
        assert_eq!(healthz(w).await, 503);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn f_an_etcd_that_ignores_sigterm_gets_sigkill_after_the_grace() {
    let dns = DnsServer::start().await;
    dns.set_txt(RECORD, &[US]).await;
    let etcd = EtcdCluster::single(Release::V35).await;
    let dir = tempfile::tempdir().unwrap();
    let (url, store) = file_store(&dir);
    // A stand-in for a wedged etcd: ignores SIGTERM; found by a unique command-line token.
    let token = format!("wedged-etcd-{}", std::process::id());
    let mut wedged = std::process::Command::new("sh")
        .args([
            "-c",
            &format!("trap '' TERM; while :; do sleep 0.1; done # {token}"),
        ])
        .spawn()
        .unwrap();
    let w = Warden::start(&[
        ("etcd.endpoints", etcd.endpoints()[0].clone()),
        ("store.url", url),
        ("owner.name", RECORD.into()),
        ("owner.id", US.into()),
        ("owner.interval", "300ms".into()),
        ("owner.ttl_cap", "0s".into()),
        ("owner.nameservers", dns.addr().to_string()),
        ("kill.process_name", "sh".into()),
        ("kill.cmdline_contains", token.clone()),
        ("kill.grace", "1s".into()),
    ]);
    until_active(&w, &store).await;
    dns.set_txt(RECORD, &[THEM]).await;
    let t0 = Instant::now();
    let status = loop {
        if let Some(status) = wedged.try_wait().unwrap() {
            break status;
        }
        if t0.elapsed() > Duration::from_secs(10) {
            let _ = wedged.kill();
            panic!("the process survived:\n{}", w.log_text());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9),
        "killed by SIGKILL: {status:?}"
    );
    assert!(
        t0.elapsed() >= Duration::from_secs(1),
        "not before the grace: {:?}",
        t0.elapsed()
    );
    // The kill is counted once the watchdog has seen the process gone.
    let counted = eventually(Duration::from_secs(5), || async {
        let (_, m) = w.get("/metrics").await.unwrap();
        let m = m.as_str().unwrap_or_default().to_string();
        m.contains("etcd_warden_owner_kills_total{signal=\"SIGTERM\"} 1")
            && m.contains("etcd_warden_owner_kills_total{signal=\"SIGKILL\"} 1")
    })
    .await;
    let (_, metrics) = w.get("/metrics").await.unwrap();
    assert!(
        counted,
        "{}",
        metrics
            .as_str()
            .unwrap()
            .lines()
            .filter(|l| l.contains("kills"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
