//! The ownership protocol end to end with real processes: the DNS server answers the owner TXT
//! record, a real etcd runs under a "kubelet" that restarts it when it dies, `etcd-warden serve`
//! runs as a child process, and snapshots go to a real S3 server or a local directory.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_warden::store::{Kind, SnapshotStore};
use support::dns::{DnsServer, Mode};
use support::etcd::{EtcdCluster, Release};
use support::pod::Pod;
use support::s3::S3Server;
use support::warden::Warden;
use support::{eventually, finals};

/// The owner record the tests' DNS server answers, and the seed that owns etcd at first.
pub(crate) const RECORD: &str = "owner.shoot.warden.test";
pub(crate) const US: &str = "seed-a";
const THEM: &str = "seed-b";
/// The check interval the sidecars run with.
const INTERVAL: Duration = Duration::from_millis(300);

/// The sidecar's configuration for `pod`, owner record on `dns`, snapshots to `store_url`.
async fn sidecar_keys(pod: &Pod, dns: &DnsServer, store_url: &str) -> Vec<(&'static str, String)> {
    member_keys(pod, 0, dns, store_url).await
}

/// The configuration of the sidecar next to member `i` of `pod` (shared with the Kubernetes
/// face's hand-off tests).
pub(crate) async fn member_keys(
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
        ("kill.settle", "1s".into()),
    ]
}

async fn healthz(w: &Warden) -> u16 {
    w.get("/healthz").await.map(|(c, _)| c).unwrap_or(0)
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

/// A seed's parts: a DNS server whose owner record names us, etcd in a pod of one or more
/// members restarted by a kubelet, and a local store (its URL, the store, the directory that
/// holds it).
async fn seed(members: usize) -> (DnsServer, Pod, String, SnapshotStore, tempfile::TempDir) {
    let dns = DnsServer::start().await;
    dns.set_txt(RECORD, &[US]).await;
    let pod = if members == 1 {
        Pod::start().await
    } else {
        Pod::cluster(members).await
    };
    let dir = tempfile::tempdir().unwrap();
    let (url, store) = file_store(&dir);
    (dns, pod, url, store, dir)
}

/// A sidecar for every member of `pod` with `changes` to its keys, once each is Active.
async fn active_cluster(
    pod: &Pod,
    dns: &DnsServer,
    url: &str,
    store: &SnapshotStore,
    changes: &[(&'static str, &str)],
) -> Vec<Warden> {
    let n = pod.etcd.lock().await.members.len();
    let mut wardens = Vec::new();
    for i in 0..n {
        let keys = member_keys(pod, i, dns, url).await;
        wardens.push(Warden::start(&changed(keys, changes)));
    }
    for w in &wardens {
        until_active(w, store).await;
    }
    wardens
}

/// Every sidecar's log, one after another.
/// Waits up to `timeout` until each of the three `wardens`' `/status` names a final snapshot
/// (`name`, when given): every sidecar settles on it. Fails saying `what`, with their logs.
async fn all_report_a_final(wardens: &[Warden], name: Option<&str>, timeout: Duration, what: &str) {
    let settled = eventually(timeout, || async {
        let mut on_it = 0;
        for w in wardens {
            if let Some((_, s)) = w.get("/status").await {
                let last = &s["owner"]["finalSnapshot"];
                if last.is_string() && name.is_none_or(|n| last.as_str() == Some(n)) {
                    on_it += 1;
                }
            }
        }
        on_it == 3
    })
    .await;
    assert!(
        settled,
        "{what}: not every sidecar names {}:\n{}",
        name.unwrap_or("a final snapshot"),
        all_logs(wardens)
    );
}

fn all_logs(wardens: &[Warden]) -> String {
    wardens
        .iter()
        .map(Warden::log_text)
        .collect::<Vec<_>>()
        .join("\n-----\n")
}

/// Waits up to `secs` for exactly one final snapshot in the store.
async fn until_one_final(store: &SnapshotStore, w: &Warden, secs: u64) {
    let one = eventually(Duration::from_secs(secs), || async {
        finals(store).await.len() == 1
    })
    .await;
    assert!(one, "no final snapshot:\n{}", w.log_text());
}

/// Waits until the pod's etcd was killed (and restarted by the kubelet) at least once.
async fn until_killed(pod: &Pod, w: &Warden) {
    let killed = eventually(Duration::from_secs(15), || async { pod.deaths() >= 1 }).await;
    assert!(killed, "etcd was not killed:\n{}", w.log_text());
}

/// A sidecar for `pod`'s first member with `changes` to its keys, once Active.
async fn active(
    pod: &Pod,
    dns: &DnsServer,
    url: &str,
    store: &SnapshotStore,
    changes: &[(&'static str, &str)],
) -> Warden {
    let w = Warden::start(&changed(sidecar_keys(pod, dns, url).await, changes));
    until_active(&w, store).await;
    w
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
    let (dns, pod, url, store, _dir) = seed(1).await;
    let w = active(&pod, &dns, &url, &store, &[]).await;

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

    until_killed(&pod, &w).await;
    until_one_final(&store, &w, 20).await;
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
    let (dns, pod, url, store, _dir) = seed(1).await;
    let w = active(&pod, &dns, &url, &store, &[]).await;

    dns.stop().await;
    time_to_503(&w, Instant::now()).await;
    until_killed(&pod, &w).await;
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
    until_one_final(&store, &w, 20).await;
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
    until_killed(&pod, &w).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        healthz(&w).await,
        503,
        "unready while the final snapshot cannot be stored"
    );

    s3.resume();
    until_one_final(&store, &w, 30).await;
    assert!(finals(&store).await[0].last_revision >= acknowledged);
    tokio::time::sleep(INTERVAL * 3).await;
    assert_eq!(finals(&store).await.len(), 1, "exactly one");
}

#[tokio::test(flavor = "multi_thread")]
async fn e_a_restarted_sidecar_takes_no_second_final_snapshot() {
    let (dns, pod, url, store, _dir) = seed(1).await;
    let mut w = active(&pod, &dns, &url, &store, &[]).await;
    dns.set_txt(RECORD, &[THEM]).await;
    until_one_final(&store, &w, 20).await;

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
    let (dns, pod, url, store, _dir) = seed(3).await;
    let wardens = active_cluster(&pod, &dns, &url, &store, &[]).await;
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
    let logs = || all_logs(&wardens);
    assert!(one, "no final snapshot:\n{}", logs());
    // Every sidecar sees its deactivation through: the final snapshot is done for all of them.
    all_report_a_final(&wardens, None, Duration::from_secs(15), "the cluster").await;
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

/// The member that takes the final (the lowest started member ID) dies for good right after
/// its fence: its sidecar and its etcd never come back. Another fenced member takes the final
/// over once `owner.takeover_after` has passed, and it holds every acknowledged write.
#[tokio::test(flavor = "multi_thread")]
async fn k_a_taker_that_never_returns_is_taken_over_with_one_final() {
    use etcd_warden::owner::handoff::HandOffObjects;
    let (dns, pod, url, store, _dir) = seed(3).await;
    let mut wardens =
        active_cluster(&pod, &dns, &url, &store, &[("owner.takeover_after", "2s")]).await;
    // Which member takes the final: every sidecar computes the lowest started member ID.
    let mut ids = Vec::new();
    for w in &wardens {
        let s = owner_status(w).await;
        let id = s["memberId"].as_str().expect("member id").to_string();
        ids.push(u64::from_str_radix(&id, 16).expect("hex"));
    }
    let taker = (0..3).min_by_key(|&i| ids[i]).expect("a taker");
    let acknowledged = pod.write("before-flip", 30).await;

    dns.set_txt(RECORD, &[THEM]).await;
    let objects = HandOffObjects::new(store.clone());
    let fenced = eventually(Duration::from_secs(30), || async {
        objects
            .fenced()
            .await
            .is_ok_and(|f| f.contains(&ids[taker]))
    })
    .await;
    assert!(
        fenced,
        "the taker never fenced:\n{}",
        wardens[taker].log_text()
    );
    wardens[taker].kill();
    pod.bury(taker).await;

    let one = eventually(Duration::from_secs(40), || async {
        finals(&store).await.len() == 1
    })
    .await;
    let logs = || all_logs(&wardens);
    assert!(one, "no final after the taker died:\n{}", logs());
    let f = finals(&store).await;
    assert!(f[0].last_revision >= acknowledged, "{f:?}");
    let claims = objects.claims().await.unwrap();
    assert!(
        claims
            .iter()
            .any(|c| c.epoch >= 1 && c.member() != Some(ids[taker])),
        "taken over by another member: {claims:?}"
    );
    // The survivors settle on it and no second final follows.
    tokio::time::sleep(INTERVAL * 6).await;
    assert_eq!(finals(&store).await.len(), 1, "{}", logs());
    assert!(objects.record().await.unwrap().is_some());
}

/// Each member's ID, as its own etcd reports it.
async fn member_ids(pod: &Pod) -> Vec<u64> {
    let urls: Vec<String> = {
        let c = pod.etcd.lock().await;
        c.members.iter().map(|m| m.client_url()).collect()
    };
    let mut ids = Vec::new();
    for url in urls {
        let mut c = etcd_client::Client::connect([url], None)
            .await
            .expect("connect");
        let status = c.status().await.expect("status");
        ids.push(status.header().expect("header").member_id());
    }
    ids
}

/// A rolling update: the previous release (`WARDEN_PREVIOUS_BIN`, a build of `7154377`,
/// which knows no final intent and no claims) and this one run side by side, once with the
/// previous release as the member that takes the final and once with it on the two that wait.
/// Each hand-off ends with exactly one final holding every acknowledged write, the hand-off
/// record names it, every sidecar of either version settles on it, and this version's reader
/// ([`etcd_warden::owner::handoff::the_final`]) agrees. Both versions run with their defaults
/// (`owner.takeover_after` 5 m): a taker of either version stores the final long before a
/// waiting member would take it over. CI builds the previous release with
/// `scripts/build-previous` and sets the variable; without it (a plain `cargo test`, or a clone
/// without that commit) the test says it is skipped and passes.
#[tokio::test(flavor = "multi_thread")]
async fn l_a_rolling_update_with_the_previous_release_ends_with_one_final() {
    use etcd_warden::owner::handoff::HandOffObjects;
    let previous = match std::env::var("WARDEN_PREVIOUS_BIN") {
        Ok(p) if !p.is_empty() => std::path::PathBuf::from(p),
        _ => {
            eprintln!(
                "SKIPPED: WARDEN_PREVIOUS_BIN is not set; run \
                 `WARDEN_PREVIOUS_BIN=$(./scripts/build-previous) cargo test --test it ownership::l_a_rolling`"
            );
            return;
        }
    };
    assert!(previous.is_file(), "{} is not a file", previous.display());
    for previous_takes in [true, false] {
        let (dns, pod, url, store, _dir) = seed(3).await;
        let ids = member_ids(&pod).await;
        let taker = (0..3).min_by_key(|&i| ids[i]).expect("a taker");
        let mut wardens = Vec::new();
        let mut versions = Vec::new();
        for i in 0..3 {
            let keys = member_keys(&pod, i, &dns, &url).await;
            let old = (i == taker) == previous_takes;
            versions.push(if old { "previous" } else { "new" });
            wardens.push(if old {
                Warden::start_binary(&keys, &previous)
            } else {
                Warden::start(&keys)
            });
        }
        for w in &wardens {
            until_active(w, &store).await;
        }
        let acknowledged = pod.write("rolling", 30).await;
        dns.set_txt(RECORD, &[THEM]).await;

        let logs = || all_logs(&wardens);
        let what = format!("taker m{taker} runs the {} release", versions[taker]);
        let one = eventually(Duration::from_secs(40), || async {
            finals(&store).await.len() == 1
        })
        .await;
        assert!(one, "{what}: no final:\n{}", logs());
        // Every sidecar settles on it, and no second final follows.
        let name = finals(&store).await[0].snap_name.clone();
        all_report_a_final(&wardens, Some(&name), Duration::from_secs(20), &what).await;
        tokio::time::sleep(INTERVAL * 6).await;
        let f = finals(&store).await;
        assert_eq!(f.len(), 1, "{what}: {f:?}\n{}", logs());
        assert!(f[0].last_revision >= acknowledged, "{what}: {f:?}");
        let objects = HandOffObjects::new(store.clone());
        let record = objects.record().await.unwrap().expect("a hand-off record");
        assert_eq!(record.final_snapshot, name, "{what}");
        let chain = objects.latest_chain().await.unwrap();
        assert!(
            chain
                .full_snapshot
                .as_ref()
                .is_some_and(|s| s.is_final && s.snap_name == name),
            "{what}: this version reads {chain:?}"
        );
        for w in &wardens {
            assert_eq!(healthz(w).await, 503, "{what}");
        }
        eprintln!("{what}: one final {name} at {}", f[0].last_revision);
        if previous_takes {
            continue;
        }

        // This version fixed an intent. The previous release's `reclaim` (which knows no
        // intents) undoes the hand-off and leaves the intent behind; the next hand-off still
        // ends with one final of its own.
        dns.set_txt(RECORD, &[US]).await;
        let keys = member_keys(&pod, 0, &dns, &url).await;
        let mut reclaim = support::warden::command_of(&previous);
        for (k, v) in &keys {
            reclaim.env(
                format!("ETCD_WARDEN_{}", k.replace('.', "_").to_ascii_uppercase()),
                v,
            );
        }
        let out = reclaim.arg("reclaim").output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            objects.intent().await.unwrap().is_none(),
            "stale intent read"
        );
        for w in &mut wardens {
            w.restart();
        }
        let back = eventually(Duration::from_secs(30), || async {
            let mut up = 0;
            for w in &wardens {
                up += usize::from(healthz(w).await == 200);
            }
            up == 3
        })
        .await;
        assert!(
            back,
            "not Active again after the reclaim:\n{}",
            all_logs(&wardens)
        );
        let acknowledged = pod.write("after-reclaim", 30).await;
        dns.set_txt(RECORD, &[THEM]).await;
        let second = eventually(Duration::from_secs(40), || async {
            objects
                .latest_chain()
                .await
                .ok()
                .and_then(|c| c.full_snapshot)
                .is_some_and(|s| s.is_final && s.snap_name != name)
        })
        .await;
        assert!(
            second,
            "no second final after the previous reclaim:\n{}",
            all_logs(&wardens)
        );
        tokio::time::sleep(INTERVAL * 6).await;
        let f = finals(&store).await;
        assert_eq!(f.len(), 2, "the reclaimed final and one more: {f:?}");
        let fin = objects.latest_chain().await.unwrap().full_snapshot.unwrap();
        assert!(fin.last_revision >= acknowledged, "{fin:?}");
        assert_eq!(
            objects.record().await.unwrap().unwrap().final_snapshot,
            fin.snap_name
        );
        eprintln!("after the previous reclaim: one final {}", fin.snap_name);
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
        ("kill.settle", "1s".into()),
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

/// The sidecar's `/status` owner object.
async fn owner_status(w: &Warden) -> serde_json::Value {
    w.get("/status")
        .await
        .map(|(_, s)| s["owner"].clone())
        .unwrap_or_default()
}

/// Waits up to `secs` until the sidecar's owner status satisfies `done`; fails with the status
/// and the log otherwise.
async fn until_owner(w: &Warden, what: &str, secs: u64, done: impl Fn(&serde_json::Value) -> bool) {
    let ok = eventually(Duration::from_secs(secs), || async {
        done(&owner_status(w).await)
    })
    .await;
    assert!(ok, "{what}: {}\n{}", owner_status(w).await, w.log_text());
}

/// The owner status, after checking its state and that its reason names every one of `parts`.
async fn owner_is(w: &Warden, state: &str, parts: &[&str]) -> serde_json::Value {
    let owner = owner_status(w).await;
    let reason = owner["reason"].as_str().unwrap_or_default();
    assert_eq!(owner["state"], state, "{owner}");
    assert!(
        parts.iter().all(|p| reason.contains(p)),
        "{parts:?} not in {reason:?}"
    );
    owner
}

/// The sidecar's metrics text.
async fn metrics(w: &Warden) -> String {
    let (_, m) = w.get("/metrics").await.unwrap();
    m.as_str().unwrap_or_default().to_string()
}

/// Writes through a client that stays connected (what an open client connection of the
/// kube-apiserver does); returns the acknowledged revisions.
async fn write_through(client: &mut etcd_client::Client, tag: &str, n: usize) -> Vec<i64> {
    let mut revs = Vec::new();
    for i in 0..n {
        if let Ok(r) = client.put(format!("/{tag}/{i}"), "v", None).await {
            revs.push(r.header().map_or(0, |h| h.revision()));
        }
    }
    revs
}

/// `keys` with `changes` applied: an existing key is replaced, a new one added.
fn changed(
    mut keys: Vec<(&'static str, String)>,
    changes: &[(&'static str, &str)],
) -> Vec<(&'static str, String)> {
    for (k, v) in changes {
        keys.retain(|(have, _)| have != k);
        keys.push((k, v.to_string()));
    }
    keys
}

/// A sidecar that cannot kill etcd (`changes` break it, `uid` runs it as another user): never
/// Active, the reason names `starting`; after the flip the kill is retried and not verified
/// (`deactivated`), no final is stored, etcd is never killed and keeps acknowledging writes.
async fn a_kill_that_cannot_happen(
    changes: &[(&'static str, &str)],
    uid: Option<u32>,
    starting: &[&str],
    deactivated: &[&str],
    metric: &str,
) {
    let (dns, pod, url, store, dir) = seed(1).await;
    if uid.is_some() {
        for p in [dir.path().to_path_buf(), dir.path().join("backups")] {
            std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o777))
                .unwrap();
        }
    }
    let w = Warden::start_as(&changed(sidecar_keys(&pod, &dns, &url).await, changes), uid);
    w.wait_up().await;
    until_owner(&w, "a reason for not becoming Active", 10, |o| {
        let r = o["reason"].as_str().unwrap_or_default();
        starting.iter().all(|p| r.contains(p))
    })
    .await;
    tokio::time::sleep(INTERVAL * 3).await;
    assert_eq!(
        healthz(&w).await,
        503,
        "never ready: it could not kill etcd"
    );
    owner_is(&w, "starting", starting).await;
    assert!(
        store.list().await.unwrap().is_empty(),
        "no snapshot while not Active"
    );

    let mut open = etcd_client::Client::connect([pod.endpoint().await], None)
        .await
        .unwrap();
    dns.set_txt(RECORD, &[THEM]).await;
    until_owner(&w, "kill retried", 10, |o| {
        o["kill"]["attempts"].as_u64() >= Some(3)
    })
    .await;
    let owner = owner_is(&w, "deactivated", deactivated).await;
    assert_eq!(owner["kill"]["verified"], false, "{owner}");
    assert!(
        finals(&store).await.is_empty(),
        "no final while etcd may serve"
    );
    assert_eq!(pod.deaths(), 0, "etcd was not (could not be) killed");
    // etcd still acknowledges writes on open connections: no final claims to hold them all.
    assert_eq!(write_through(&mut open, "after-flip", 5).await.len(), 5);
    assert!(metrics(&w).await.contains(metric), "{}", metrics(&w).await);
    assert!(w.log_text().contains("no final snapshot until it is"));
}

#[tokio::test(flavor = "multi_thread")]
async fn g_a_process_name_that_matches_nothing_never_becomes_active_and_takes_no_final() {
    // An image whose etcd runs as `etcd-wrapper`: the configured name matches nothing.
    a_kill_that_cannot_happen(
        &[("kill.process_name", "etcd-wrapper")],
        None,
        &["not visible", "etcd-wrapper"],
        &["not verified", "no etcd process found"],
        "etcd_warden_owner_kill_attempts_total{result=\"not_found\"}",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn h_a_sidecar_that_may_not_signal_etcd_never_becomes_active_and_takes_no_final() {
    // The sidecar runs as "nobody", etcd as root, and no CAP_KILL: every signal is EPERM.
    a_kill_that_cannot_happen(
        &[],
        Some(65534),
        &["EPERM"],
        &["not verified", "EPERM", "CAP_KILL"],
        "etcd_warden_owner_kill_attempts_total{result=\"refused\"}",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn i_a_stale_final_never_stands_in_and_nothing_follows_the_hand_offs_final() {
    let (dns, pod, url, store, _dir) = seed(1).await;
    let w = active(&pod, &dns, &url, &store, &[("server.token", "t0ken")]).await;
    let http = reqwest::Client::new();
    let post = |path: &str| http.post(w.url(path)).bearer_auth("t0ken").send();
    let refused = |code: &'static str, path: &'static str| {
        let post = &post;
        async move {
            let r = post(path).await.unwrap();
            assert_eq!(r.status().as_u16(), 409, "{path}");
            assert_eq!(
                r.json::<serde_json::Value>().await.unwrap()["code"],
                code,
                "{path}"
            );
        }
    };

    // A final while Active is refused.
    refused("not_deactivated", "/snapshot/full?final=true").await;
    // An old final in the store (an earlier hand-off, or one taken by hand): acknowledged
    // writes follow it.
    let before = pod.write("before-stale", 3).await;
    let stale = store.new_snapshot(Kind::Full, 0, before, etcd_warden::store::Codec::Gzip, true);
    store
        .put_bytes(&stale, bytes::Bytes::from_static(b"an earlier final"))
        .await
        .unwrap();
    let acknowledged = pod.write("after-stale", 20).await;

    dns.set_txt(RECORD, &[THEM]).await;
    until_owner(&w, "the hand-off's final", 20, |o| {
        o["finalSnapshot"].is_string()
    })
    .await;
    let name = owner_status(&w).await["finalSnapshot"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(
        name, stale.snap_name,
        "the stale final stood in for the hand-off's"
    );
    let f = finals(&store).await;
    let taken = f.iter().find(|s| s.snap_name == name).expect("listed");
    assert!(
        taken.last_revision >= acknowledged,
        "the hand-off's final at {} misses writes up to {acknowledged}",
        taken.last_revision
    );
    assert_eq!(
        f.len(),
        2,
        "the stale one and exactly one of this hand-off: {f:?}"
    );

    // Deactivated: nothing but the final, so it stays the latest.
    refused("deactivated", "/snapshot/full").await;
    refused("deactivated", "/snapshot/delta").await;
    let r = post("/snapshot/full?final=true").await.unwrap();
    assert_eq!(
        r.status().as_u16(),
        200,
        "answers with the hand-off's final"
    );
    assert_eq!(
        r.json::<serde_json::Value>().await.unwrap()["snapName"],
        name.as_str()
    );
    let (_, latest) = w.get("/snapshot/latest").await.unwrap();
    assert_eq!(
        latest["fullSnapshot"]["snapName"],
        name.as_str(),
        "{latest}"
    );
    assert_eq!(latest["fullSnapshot"]["isFinal"], true);
    assert_eq!(finals(&store).await.len(), 2);
}

/// Under etcd-druid with an owner record: druid's requested final (`POST
/// /snapshot/full?final=true`, no token) taken while Active is a full snapshot named final and
/// marked druid's; it never stands in for the hand-off's final, which still holds every write
/// acknowledged after it; once handed off, druid's request is answered with the hand-off's
/// final and nothing new is taken. (No etcd-wrapper here: etcd runs before the sidecar.)
#[tokio::test(flavor = "multi_thread")]
async fn i2_druids_requested_final_never_stands_in_for_the_hand_offs() {
    let (dns, pod, url, store, dir) = seed(1).await;
    let conf = dir.path().join("etcd.conf.yaml");
    std::fs::write(&conf, "name: etcd-config\n").unwrap();
    let conf = conf.display().to_string();
    let w = active(
        &pod,
        &dns,
        &url,
        &store,
        &[
            ("druid.etcd_config", &conf),
            ("druid.pod_name", "etcd-test-0"),
        ],
    )
    .await;
    let http = reqwest::Client::new();
    let druid_final = || async {
        let r = http
            .post(w.url("/snapshot/full?final=true"))
            .send()
            .await
            .unwrap();
        let code = r.status().as_u16();
        (code, r.json::<serde_json::Value>().await.unwrap())
    };

    pod.write("before-druid", 3).await;
    let (code, body) = druid_final().await;
    assert_eq!(code, 200, "{body}\n{}", w.log_text());
    let druids = body["snapName"].as_str().unwrap().to_string();
    assert!(druids.ends_with(".final"), "{body}");
    let marked = etcd_warden::store::gc::requested_finals(&store)
        .await
        .unwrap();
    assert!(marked.contains(&druids), "{druids} not marked: {marked:?}");
    let acknowledged = pod.write("after-druid", 20).await;

    dns.set_txt(RECORD, &[THEM]).await;
    until_owner(&w, "the hand-off's final", 20, |o| {
        o["finalSnapshot"].is_string()
    })
    .await;
    let name = owner_status(&w).await["finalSnapshot"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(name, druids, "druid's final stood in for the hand-off's");
    let f = finals(&store).await;
    let taken = f.iter().find(|s| s.snap_name == name).expect("listed");
    assert!(
        taken.last_revision >= acknowledged,
        "the hand-off's final at {} misses writes up to {acknowledged}",
        taken.last_revision
    );
    assert_eq!(f.len(), 2, "druid's and the hand-off's: {f:?}");

    // Handed off: druid's request is answered with the hand-off's final, nothing new taken.
    let (code, body) = druid_final().await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["snapName"], name.as_str(), "{body}");
    let (_, latest) = w.get("/snapshot/latest").await.unwrap();
    assert_eq!(
        latest["fullSnapshot"]["snapName"],
        name.as_str(),
        "{latest}"
    );
    assert_eq!(latest["fullSnapshot"]["isFinal"], true, "{latest}");
    assert_eq!(finals(&store).await.len(), 2);
    let marked = etcd_warden::store::gc::requested_finals(&store)
        .await
        .unwrap();
    assert!(
        !marked.contains(&name),
        "the hand-off's final marked druid's"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn j_a_restarted_sidecar_named_again_stays_handed_off_until_reclaimed() {
    let (dns, pod, url, store, _dir) = seed(1).await;
    let keys = sidecar_keys(&pod, &dns, &url).await;
    let mut w = Warden::start(&keys);
    until_active(&w, &store).await;
    dns.set_txt(RECORD, &[THEM]).await;
    until_owner(&w, "the hand-off's final", 20, |o| {
        o["finalSnapshot"].is_string()
    })
    .await;
    let cli = |args: &[&str]| {
        let mut c = support::warden::command();
        for (k, v) in &keys {
            c.env(
                format!("ETCD_WARDEN_{}", k.replace('.', "_").to_ascii_uppercase()),
                v,
            );
        }
        let out = c.args(args).output().unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.success(), text(&out.stdout), text(&out.stderr))
    };
    // Undoing the hand-off while the record names another seed is refused.
    let (ok, _, err) = cli(&["reclaim"]);
    assert!(!ok && err.contains("refusing to reclaim"), "{err}");

    // The record names us again (a rolled-back migration, a stale DNS answer) and the sidecar
    // restarts: it must not serve, a destination may be running from the final.
    dns.set_txt(RECORD, &[US]).await;
    w.restart();
    w.wait_up().await;
    until_owner(&w, "handed off after a restart", 15, |o| {
        o["state"] == "deactivated" && o["finalSnapshot"].is_string()
    })
    .await;
    tokio::time::sleep(INTERVAL * 4).await;
    assert_eq!(healthz(&w).await, 503);
    assert_eq!(finals(&store).await.len(), 1, "no second final");
    assert!(w.log_text().contains("handed off earlier"));
    // A manual final while the record names this seed is refused too.
    let (ok, _, err) = cli(&["snapshot", "--final"]);
    assert!(!ok && err.contains("refusing a final snapshot"), "{err}");

    // The deliberate undo: reclaim, restart, Active again.
    let (ok, said, err) = cli(&["reclaim"]);
    assert!(ok, "{err}");
    assert!(
        said.contains("removed fence marker") && said.contains("reclaimed final"),
        "{said}"
    );
    w.restart();
    let back = eventually(Duration::from_secs(20), || async {
        healthz(&w).await == 200
    })
    .await;
    assert!(back, "{}\n{}", owner_status(&w).await, w.log_text());

    // Serving again: the reclaimed final is a plain full snapshot to every reader, so a flow
    // polling `/snapshot/latest` for `isFinal` never takes it for the next hand-off's final.
    let reclaimed = finals(&store).await[0].snap_name.clone();
    let (_, latest) = w.get("/snapshot/latest").await.unwrap();
    assert_eq!(latest["fullSnapshot"]["isFinal"], false, "{latest}");
    let acknowledged = pod.write("after-reclaim", 30).await;

    // The second hand-off: until its own final is stored, nothing reads as final.
    dns.set_txt(RECORD, &[THEM]).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let second = loop {
        assert!(
            Instant::now() < deadline,
            "no second final:\n{}",
            w.log_text()
        );
        let (_, latest) = w.get("/snapshot/latest").await.unwrap_or_default();
        let full = &latest["fullSnapshot"];
        if full["isFinal"] == true {
            let name = full["snapName"].as_str().unwrap_or_default().to_string();
            assert_ne!(
                name, reclaimed,
                "the reclaimed final read as final: {latest}"
            );
            break name;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let fin = store
        .list()
        .await
        .unwrap()
        .into_iter()
        .find(|s| s.snap_name == second)
        .expect("listed");
    assert!(
        fin.last_revision >= acknowledged,
        "the second final misses writes acknowledged after the reclaim"
    );
    let (ok, said, err) = cli(&["ls"]);
    assert!(ok, "{err}");
    let marked: Vec<&str> = said
        .lines()
        .filter(|l| l.split_whitespace().nth(4) == Some("yes"))
        .collect();
    assert_eq!(marked.len(), 1, "`ls` marks one final: {said}");
    assert!(marked[0].ends_with(&second), "{said}");
}

/// Runs `etcd-warden args` with `keys` in its environment: (succeeded, stdout, stderr).
fn run_cli(keys: &[(&str, String)], args: &[&str]) -> (bool, String, String) {
    let mut c = support::warden::command();
    for (k, v) in keys {
        c.env(
            format!("ETCD_WARDEN_{}", k.replace('.', "_").to_ascii_uppercase()),
            v,
        );
    }
    let out = c.args(args).output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

#[tokio::test(flavor = "multi_thread")]
async fn j2_the_snapshot_command_is_refused_while_a_hand_off_is_in_the_store() {
    use etcd_warden::owner::handoff::{self, FenceMarker, HandOffObjects, HandOffRecord};
    let (dns, pod, url, store, _dir) = seed(1).await;
    let keys = sidecar_keys(&pod, &dns, &url).await;
    let objects = HandOffObjects::new(store.clone());
    // No hand-off objects: a plain snapshot is taken as always.
    let (ok, said, err) = run_cli(&keys, &["snapshot"]);
    assert!(ok, "{err}");
    assert!(said.starts_with("Full-"), "{said}");

    // A member fenced: neither form runs, even when DNS says another seed owns etcd (the DNS
    // rule alone let `--final` through here).
    let marker = FenceMarker {
        member_id: "1".into(),
        owner_id: US.into(),
        reason: "owned by seed-b".into(),
        killed: vec![],
        fenced_at: chrono::Utc::now(),
    };
    objects.write_fence(1, &marker).await.unwrap();
    let (ok, _, err) = run_cli(&keys, &["snapshot"]);
    assert!(!ok, "a snapshot was taken during a hand-off");
    assert!(
        err.contains("refusing a snapshot") && err.contains("1 fence marker(s)"),
        "{err}"
    );
    dns.set_txt(RECORD, &[THEM]).await;
    let (ok, _, err) = run_cli(&keys, &["snapshot", "--final"]);
    assert!(!ok, "a final was taken by hand during a hand-off");
    assert!(
        err.contains("refusing a final snapshot") && err.contains("fence marker"),
        "{err}"
    );

    // The hand-off recorded: the record is named.
    let taken = store.list().await.unwrap().pop().unwrap();
    objects
        .write_record(&HandOffRecord {
            final_snapshot: taken.snap_name.clone(),
            revision: taken.last_revision,
            members: vec!["m1".into()],
            owner_id: US.into(),
            recorded_at: chrono::Utc::now(),
        })
        .await
        .unwrap();
    let (ok, _, err) = run_cli(&keys, &["snapshot"]);
    assert!(!ok && err.contains("handoff.json"), "{err}");
    assert_eq!(store.list().await.unwrap().len(), 1, "nothing was stored");

    // Reclaimed (the record names us again): snapshots run again.
    dns.set_txt(RECORD, &[US]).await;
    handoff::reclaim(&objects).await.unwrap();
    // A write first, so the new snapshot's name (its revision) differs from the first one's.
    let endpoint = pod.etcd.lock().await.members[0].client_url();
    let mut client = etcd_client::Client::connect([endpoint], None)
        .await
        .unwrap();
    write_through(&mut client, "after-reclaim", 1).await;
    let (ok, said, err) = run_cli(&keys, &["snapshot"]);
    assert!(ok, "{err}");
    assert_eq!(store.list().await.unwrap().len(), 2, "{said}");
}

#[tokio::test(flavor = "multi_thread")]
async fn k_a_member_that_still_serves_holds_the_final_back() {
    // Two DNS servers: members 0 and 1 see the flip, member 2's sidecar still sees its seed
    // (its resolver lags). Writes through member 2 keep committing.
    let (dns, pod, url, store, _dir) = seed(3).await;
    let lagging = DnsServer::start().await;
    lagging.set_txt(RECORD, &[US]).await;
    let mut wardens = Vec::new();
    for i in 0..3 {
        let server = if i == 2 { &lagging } else { &dns };
        wardens.push(Warden::start(&member_keys(&pod, i, server, &url).await));
    }
    for w in &wardens {
        until_active(w, &store).await;
    }
    let member2 = pod.etcd.lock().await.members[2].client_url();
    let mut open = etcd_client::Client::connect([member2], None).await.unwrap();

    dns.set_txt(RECORD, &[THEM]).await;
    for w in &wardens[..2] {
        until_owner(w, "fenced and waiting for member 2", 20, |o| {
            o["waitingFor"].as_array().is_some_and(|a| !a.is_empty())
        })
        .await;
    }
    // Member 2 still serves: its writes commit, and no final is taken meanwhile.
    let mut acknowledged = Vec::new();
    for round in 0..4 {
        acknowledged.extend(write_through(&mut open, &format!("lag{round}"), 10).await);
        tokio::time::sleep(INTERVAL).await;
    }
    assert!(
        acknowledged.len() >= 30,
        "member 2 serves: {acknowledged:?}"
    );
    assert!(
        finals(&store).await.is_empty(),
        "a final while a member serves"
    );
    owner_is(&wardens[0], "deactivated", &["waiting for"]).await;

    // Member 2's resolver catches up: it is fenced, and only now the final.
    lagging.set_txt(RECORD, &[THEM]).await;
    let one = eventually(Duration::from_secs(30), || async {
        finals(&store).await.len() == 1
    })
    .await;
    let logs: Vec<String> = wardens.iter().map(Warden::log_text).collect();
    assert!(one, "{}", logs.join("\n-----\n"));
    let last = *acknowledged.iter().max().unwrap();
    let f = &finals(&store).await[0];
    assert!(
        f.last_revision >= last,
        "final at {} misses writes acknowledged by the lagging member up to {last}",
        f.last_revision
    );
    tokio::time::sleep(INTERVAL * 4).await;
    assert_eq!(finals(&store).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_json_log_shows_spans_for_an_ownership_check_and_a_snapshot() {
    let (dns, pod, url, store, _dir) = seed(1).await;
    let w = active(&pod, &dns, &url, &store, &[("log.format", "json")]).await;
    let lines: Vec<serde_json::Value> = w
        .log_text()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let in_span = |name: &str| {
        lines.iter().find(|l| {
            l["spans"]
                .as_array()
                .is_some_and(|s| s.iter().any(|s| s["name"] == name))
        })
    };
    let check =
        in_span("owner_check").unwrap_or_else(|| panic!("no owner_check span:\n{}", w.log_text()));
    assert_eq!(check["span"]["owner_id"], US, "{check}");
    let snapshot = in_span("full_snapshot")
        .unwrap_or_else(|| panic!("no full_snapshot span:\n{}", w.log_text()));
    assert!(snapshot["span"]["is_final"].is_boolean(), "{snapshot}");
    assert!(
        lines.iter().any(|l| l["snapshot"].is_string()
            && l["revision"].is_number()
            && l["spans"]
                .as_array()
                .is_some_and(|s| s.iter().any(|s| s["name"] == "full_snapshot"))),
        "a stored snapshot's name and revision inside its span:\n{}",
        w.log_text()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn with_etcd_auth_on_the_final_is_taken_after_the_kill_restarted_etcd() {
    // etcd's simple tokens do not survive a restart: the sidecar's clients must get new ones.
    let (dns, pod, url, store, _dir) = seed(1).await;
    let acknowledged = pod.write("before-auth", 5).await;
    let mut admin = etcd_client::Client::connect([pod.endpoint().await], None)
        .await
        .unwrap();
    admin.user_add("root", "s3cret", None).await.unwrap();
    admin.user_grant_role("root", "root").await.unwrap();
    admin.auth_enable().await.unwrap();
    let w = active(
        &pod,
        &dns,
        &url,
        &store,
        &[("etcd.username", "root"), ("etcd.password", "s3cret")],
    )
    .await;
    dns.set_txt(RECORD, &[THEM]).await;
    until_killed(&pod, &w).await;
    until_one_final(&store, &w, 30).await;
    assert!(finals(&store).await[0].last_revision >= acknowledged);
    owner_is(&w, "deactivated", &["final snapshot"]).await;
}
