//! A lost member of a healthy 3-member etcd 3.5 rejoins as a learner, is promoted, and loses no
//! acknowledged write; the store is never read. A corrupt directory is moved aside; without
//! quorum nothing changes.

use crate::support;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions, GetOptions, MemberAddOptions};
use etcd_warden::config::{EtcdConfig, RestoreConfig};
use etcd_warden::restore::datadir::{DataDir, check};
use etcd_warden::restore::initialize::InitializeMetrics;

/// Whether `dir` passes the full validation a restart would apply.
fn is_valid_data_dir(dir: &std::path::Path) -> bool {
    matches!(
        check(dir, etcd_warden::config::Validation::Full),
        DataDir::Valid { .. }
    )
}
use etcd_warden::restore::rejoin::{self, Journal, RejoinError};
use etcd_warden::store::{Codec, Kind, SnapshotStore};
use support::etcd::{EtcdCluster, Release};
use support::warden::Warden;
use support::writer::Writer;
use support::{eventually, free_port};
use tokio_util::sync::CancellationToken;

/// The library's logs, shown with a failing test's output.
fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("etcd_warden=debug")
        .with_test_writer()
        .try_init();
}

/// A client with timeouts, so a test fails instead of hanging.
async fn connect<S: AsRef<str>>(urls: &[S]) -> Client {
    let opts = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_timeout(Duration::from_secs(10));
    let urls: Vec<&str> = urls.iter().map(AsRef::as_ref).collect();
    Client::connect(urls, Some(opts)).await.unwrap()
}

/// `name=peerURL,...` of every member, as each was started.
fn initial_cluster(etcd: &EtcdCluster) -> String {
    etcd.members
        .iter()
        .map(|m| format!("{}={}", m.name, m.peer_url()))
        .collect::<Vec<_>>()
        .join(",")
}

/// The restore section for member `i` rejoining through every member's client URL.
fn restore_config(etcd: &EtcdCluster, i: usize, timeout: Duration) -> RestoreConfig {
    let m = &etcd.members[i];
    RestoreConfig {
        data_dir: Some(m.data_dir.clone()),
        name: m.name.clone(),
        initial_cluster: initial_cluster(etcd),
        initial_cluster_token: "ignored-on-join".into(),
        initial_advertise_peer_urls: m.peer_url(),
        etcd_bin: Some(Release::V35.bin_dir()),
        parallel_fetch: 1,
        force: false,
        initialize: true,
        validation: etcd_warden::config::Validation::Sanity,
        fallback: true,
        guard: None,
        work_dir: None,
        cluster: Some(EtcdConfig {
            endpoints: etcd.endpoints(),
            tls: None,
            username: None,
            password: None,
            connect_timeout: Duration::from_secs(1),
            request_timeout: Duration::from_secs(3),
        }),
        rejoin_timeout: timeout,
        bump_revision: 0,
        mark_compacted: false,
        read_limits: Default::default(),
    }
}

/// A store in memory, empty.
fn empty_store() -> SnapshotStore {
    SnapshotStore::new(
        std::sync::Arc::new(object_store::memory::InMemory::new()),
        "",
    )
}

/// `rejoin::rejoin_if_lost` as `serve` calls it, with an empty store and a token never cancelled.
async fn initialize(config: &RestoreConfig) -> Result<bool, RejoinError> {
    let cancel = CancellationToken::new();
    rejoin::rejoin_if_lost(
        config,
        &InitializeMetrics::default(),
        &empty_store(),
        &cancel,
    )
    .await
}

/// `member` started again serves the key `/w/before` written before it stopped, on its own.
async fn member_back_with_the_write(member: &mut support::etcd::EtcdMember) {
    member.start();
    member.wait_healthy(Duration::from_secs(30)).await;
    let mut c = connect(&[member.client_url()]).await;
    let got = c
        .get("/w/before", Some(GetOptions::new().with_serializable()))
        .await
        .unwrap();
    assert_eq!(got.kvs().len(), 1);
}

/// Three members with `/w/before` written, then m2 killed; returns them, a client of the other
/// two, and m2's data directory.
async fn third_lost() -> (EtcdCluster, Client, PathBuf) {
    let mut etcd = EtcdCluster::start(3, Release::V35).await;
    let mut client = connect(&etcd.endpoints()[..2]).await;
    client.put("/w/before", "1", None).await.unwrap();
    etcd.members[2].kill();
    let data = etcd.members[2].data_dir.clone();
    (etcd, client, data)
}

/// Removes m2's member (retrying while etcd refuses); returns its ID.
async fn remove_m2(client: &Client) -> u64 {
    let stale = members(&mut client.clone())
        .await
        .into_iter()
        .find(|m| m.0 == "m2")
        .unwrap()
        .1;
    let removed = eventually(Duration::from_secs(20), || {
        let mut c = client.clone();
        async move { c.member_remove(stale).await.is_ok() }
    })
    .await;
    assert!(removed);
    stale
}

/// The members, checked to be three voters.
async fn three_voters(client: &mut Client) -> Vec<(String, u64, bool)> {
    let after = members(client).await;
    assert_eq!(after.iter().filter(|m| !m.2).count(), 3, "{after:?}");
    after
}

/// (ID, is learner) of every member, by name (an unstarted learner has an empty name).
async fn members(client: &mut Client) -> Vec<(String, u64, bool)> {
    let list = client.member_list().await.unwrap();
    list.members()
        .iter()
        .map(|m| (m.name().to_owned(), m.id(), m.is_learner()))
        .collect()
}

/// Every acknowledged key of `acks` is readable from `url` alone (serializable), once that
/// member has applied up to the last acknowledged revision.
async fn assert_all_readable(url: &str, writer: &Writer) {
    let acks = writer.acks();
    let last = acks.iter().map(|a| a.revision).max().unwrap();
    let mut c = connect(&[url]).await;
    let serializable = || GetOptions::new().with_serializable();
    let caught_up = eventually(Duration::from_secs(30), || {
        let mut c = c.clone();
        async move {
            c.get("/none", Some(serializable()))
                .await
                .is_ok_and(|r| r.header().is_some_and(|h| h.revision() >= last))
        }
    })
    .await;
    assert!(caught_up, "{url} never reached revision {last}");
    let got = c
        .get("/w/", Some(serializable().with_prefix().with_keys_only()))
        .await
        .unwrap();
    let present: HashSet<&[u8]> = got.kvs().iter().map(|kv| kv.key()).collect();
    let lost: Vec<&str> = acks
        .iter()
        .filter(|a| !present.contains(a.key.as_bytes()))
        .map(|a| a.key.as_str())
        .collect();
    assert!(
        lost.is_empty(),
        "{} of {} acknowledged writes missing on {url}: {lost:?}",
        lost.len(),
        acks.len()
    );
}

async fn wait_acks(writer: &Writer, more_than: usize) {
    let ok = eventually(Duration::from_secs(20), || async {
        writer.ack_count() > more_than
    })
    .await;
    assert!(ok, "writer stuck: {:?}", writer.recent_errors());
}

/// The sidecar binary with `restore.initialize` and `restore.cluster_endpoints` rebuilds a
/// wiped member by replication: a learner first, then a voter; its store (an S3 endpoint on a
/// closed port) is never read; the member restarted with its original `new` flags is a voter
/// holding every acknowledged write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_member_rejoins_as_a_learner_and_loses_no_acknowledged_write() {
    let mut etcd = EtcdCluster::start(3, Release::V35).await;
    let mut client = connect(&etcd.endpoints()[..2]).await;
    let before = members(&mut client).await;
    let old_id = before.iter().find(|m| m.0 == "m2").unwrap().1;

    let mut writer = Writer::start(
        etcd.members[0].client_url(),
        "/w".into(),
        Instant::now(),
        Duration::from_millis(5),
    );
    wait_acks(&writer, 20).await;

    etcd.members[2].kill();
    let data = etcd.members[2].data_dir.clone();
    std::fs::remove_dir_all(&data).unwrap();
    wait_acks(&writer, writer.ack_count() + 20).await;

    let closed = free_port();
    let keys = vec![
        ("store.url", "s3://nowhere/backups".to_string()),
        ("store.endpoint", format!("http://127.0.0.1:{closed}")),
        ("store.allow_http", "true".into()),
        ("store.region", "us-east-1".into()),
        ("store.access_key_id", "k".into()),
        ("store.secret_access_key", "s".into()),
        ("etcd.endpoints", etcd.members[2].client_url()),
        ("restore.initialize", "true".into()),
        ("restore.data_dir", data.display().to_string()),
        ("restore.name", "m2".into()),
        ("restore.initial_cluster", initial_cluster(&etcd)),
        (
            "restore.initial_advertise_peer_urls",
            etcd.members[2].peer_url(),
        ),
        ("restore.cluster_endpoints", etcd.endpoints().join(",")),
        (
            "restore.etcd_bin",
            Release::V35.bin_dir().display().to_string(),
        ),
        ("restore.rejoin_timeout", "2m".into()),
    ];
    let mut warden = Warden::start(&keys);
    let rejoined = eventually(Duration::from_secs(150), || async {
        warden.log_text().contains("rejoin complete")
    })
    .await;
    assert!(rejoined, "no rejoin; log:\n{}", warden.log_text());
    // What the sidecar did up to serving (its snapshot actor may reach for the store later).
    let log = warden.log_text();
    let log = log[..log.find("rejoin complete").unwrap()].to_string();
    for step in [
        "removed this member's stale voter",
        "added as a learner",
        "promoted to voter",
    ] {
        assert!(log.contains(step), "no {step:?} in\n{log}");
    }
    assert!(
        !log.contains("from the store") && !log.contains("listing the store"),
        "the store was used:\n{log}"
    );
    // The duration under the reference's label for a learner joining. (The store behind a
    // closed port never holds a scrape: the drill record is read off the scrape's path.)
    let line =
        r#"etcdbr_restoration_duration_seconds_count{restore="single_member",succeeded="true"} 1"#;
    let deadline = Instant::now() + Duration::from_secs(20);
    let (shown, last) = loop {
        let got = warden.get("/metrics").await;
        let found = matches!(&got, Some((200, serde_json::Value::String(m))) if m.lines().any(|l| l == line));
        if found || Instant::now() > deadline {
            break (found, got);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        shown,
        "no {line} in the last answer {last:?}; log:\n{}",
        warden.log_text()
    );
    warden.kill();

    // Promoted before etcd itself starts: three voters, ours under a new ID.
    let after = members(&mut client).await;
    let ours = after.iter().find(|m| m.0 == "m2").expect("m2 listed");
    assert_ne!(ours.1, old_id, "the stale member was not replaced");
    assert!(!ours.2, "m2 is still a learner: {after:?}");
    assert_eq!(after.len(), 3, "{after:?}");
    assert!(after.iter().all(|m| !m.2), "{after:?}");

    // etcd as the pod starts it: the original flags (`new`), ignored on a member's directory.
    assert!(is_valid_data_dir(&data));
    etcd.members[2].start();
    etcd.members[2].wait_healthy(Duration::from_secs(30)).await;
    wait_acks(&writer, writer.ack_count() + 20).await;
    writer.stop().await;
    assert_all_readable(&etcd.members[2].client_url(), &writer).await;
    let status = connect(&[etcd.members[2].client_url()])
        .await
        .status()
        .await
        .unwrap();
    assert_eq!(status.header().unwrap().member_id(), ours.1);
    assert!(!status.is_learner());
}

/// A corrupt directory (not missing) is moved aside, never deleted, and a learner left by an
/// earlier attempt (added, never started) is replaced by a fresh one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_directory_is_moved_aside_and_a_leftover_learner_replaced() {
    logs();
    let (mut etcd, mut client, data) = third_lost().await;
    // Corrupt: the WAL is gone, something else is there.
    std::fs::remove_dir_all(data.join("member/wal")).unwrap();
    std::fs::write(data.join("marker"), b"keep me").unwrap();

    // An earlier attempt: the stale voter removed, a learner added, then the sidecar died.
    let stale = remove_m2(&client).await;
    // etcd refuses membership changes for a few seconds after one ("unhealthy cluster").
    let peer = etcd.members[2].peer_url();
    let mut leftover = None;
    for _ in 0..200 {
        let add = MemberAddOptions::new().with_is_learner();
        match client.member_add([peer.as_str()], Some(add)).await {
            Ok(r) => {
                leftover = r.member().map(|m| m.id());
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let leftover = leftover.expect("a learner added");
    let config = restore_config(&etcd, 2, Duration::from_secs(120));
    assert!(initialize(&config).await.unwrap());
    assert!(!Journal::path(&data).exists(), "the journal is left behind");

    assert!(is_valid_data_dir(&data));
    let aside: Vec<_> = std::fs::read_dir(data.parent().unwrap())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.display().to_string().contains("m2.etcd.old-"))
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert_eq!(std::fs::read(aside[0].join("marker")).unwrap(), b"keep me");
    let after = three_voters(&mut client).await;
    assert!(
        after.iter().all(|m| m.1 != leftover && m.1 != stale),
        "{after:?}"
    );

    member_back_with_the_write(&mut etcd.members[2]).await;
}

/// With the other voters short of quorum, nothing changes: no removal, no learner, no data
/// directory; the attempt fails when `restore.rejoin_timeout` passes, naming why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_quorum_membership_is_left_alone_and_the_attempt_fails() {
    logs();
    let mut etcd = EtcdCluster::start(3, Release::V35).await;
    let mut client = connect(&[etcd.members[0].client_url()]).await;
    let before = members(&mut client).await;
    etcd.members[1].kill();
    etcd.members[2].kill();
    let data = etcd.members[2].data_dir.clone();
    std::fs::remove_dir_all(&data).unwrap();

    let config = restore_config(&etcd, 2, Duration::from_secs(8));
    let e = initialize(&config).await.unwrap_err();
    assert!(matches!(e, RejoinError::Timeout { .. }), "{e}");
    let text = e.to_string();
    assert!(text.contains("linearizable"), "{text}");
    assert!(!data.exists(), "a data directory appeared");
    assert!(!Path::new(&format!("{}.part", data.display())).exists());

    // Quorum back (m1): the membership is as it was.
    etcd.members[1].start();
    etcd.members[1].wait_healthy(Duration::from_secs(30)).await;
    let mut after = members(&mut client).await;
    let mut before = before;
    after.sort();
    before.sort();
    assert_eq!(after, before);
}

/// A member grown by `member add` has a `restore.initial_cluster` naming it alone: the live
/// member list, not that static value, sends it to rejoin (restored from the store instead, it
/// would start a second cluster beside the running one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_initial_cluster_names_it_alone_rejoins_the_running_cluster() {
    logs();
    let (mut etcd, mut client, data) = third_lost().await;
    std::fs::remove_dir_all(&data).unwrap();

    let mut config = restore_config(&etcd, 2, Duration::from_secs(120));
    config.initial_cluster = format!("m2={}", etcd.members[2].peer_url());
    assert!(initialize(&config).await.unwrap(), "not rejoined");
    assert!(is_valid_data_dir(&data));
    three_voters(&mut client).await;

    member_back_with_the_write(&mut etcd.members[2]).await;
}

/// A new cluster: no member answers (each etcd waits for its sidecar), the store holds no
/// snapshot and the directory is missing, so the member starts fresh instead of waiting for a
/// cluster that cannot exist yet. With a snapshot in the store the same silence fails closed
/// (an unreachable cluster), until the timeout or until the sidecar is stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_cluster_starts_fresh_only_while_nobody_answers_and_the_store_is_empty() {
    logs();
    let mut etcd = EtcdCluster::start(3, Release::V35).await;
    for m in &mut etcd.members {
        m.kill();
    }
    let data = etcd.members[2].data_dir.clone();
    std::fs::remove_dir_all(&data).unwrap();
    let config = restore_config(&etcd, 2, Duration::from_secs(60));

    let begun = Instant::now();
    assert!(
        !initialize(&config).await.unwrap(),
        "a first bootstrap should be left to restore::initialize"
    );
    assert!(
        begun.elapsed() < Duration::from_secs(30),
        "{:?}",
        begun.elapsed()
    );
    assert!(!data.exists());

    let store = empty_store();
    let s = store.new_snapshot(Kind::Full, 0, 10, Codec::None, false);
    store
        .put_bytes(&s, bytes::Bytes::from_static(b"db"))
        .await
        .unwrap();
    let mut config = config;
    config.rejoin_timeout = Duration::from_secs(5);
    let never = CancellationToken::new();
    let e = rejoin::rejoin_if_lost(&config, &InitializeMetrics::default(), &store, &never)
        .await
        .unwrap_err();
    assert!(matches!(e, RejoinError::Timeout { .. }), "{e}");
    assert!(!data.exists());

    // Stopped (SIGTERM) while it waits: it returns at once.
    config.rejoin_timeout = Duration::from_secs(600);
    let cancel = CancellationToken::new();
    let stop = cancel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(2)).await;
        stop.cancel();
    });
    let begun = Instant::now();
    let e = rejoin::rejoin_if_lost(&config, &InitializeMetrics::default(), &store, &cancel)
        .await
        .unwrap_err();
    assert!(matches!(e, RejoinError::Cancelled), "{e}");
    assert!(
        begun.elapsed() < Duration::from_secs(20),
        "{:?}",
        begun.elapsed()
    );
}

/// The process died after the promotion, before the rename: its journal and a valid `.part`
/// are installed without a membership change, even with another member down (no quorum
/// until this one is back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_member_left_in_part_is_installed_from_its_journal() {
    logs();
    let mut etcd = EtcdCluster::start(3, Release::V35).await;
    let mut client = connect(&[etcd.members[0].client_url()]).await;
    client.put("/w/before", "1", None).await.unwrap();
    let mut before = members(&mut client).await;
    let id = before.iter().find(|m| m.0 == "m2").unwrap().1;
    etcd.members[2].kill();
    let data = etcd.members[2].data_dir.clone();
    let part = std::path::PathBuf::from(format!("{}.part", data.display()));
    std::fs::rename(&data, &part).unwrap();
    Journal {
        member_id: id,
        peer_urls: vec![etcd.members[2].peer_url()],
        promoted: true,
    }
    .write(&data)
    .unwrap();
    etcd.members[1].kill();

    let config = restore_config(&etcd, 2, Duration::from_secs(20));
    assert!(initialize(&config).await.unwrap());
    assert!(is_valid_data_dir(&data));
    assert!(!part.exists());
    assert!(!Journal::path(&data).exists());
    let mut after = members(&mut client).await;
    after.sort();
    before.sort();
    assert_eq!(after, before, "membership changed");

    etcd.members[2].start();
    etcd.members[2].wait_healthy(Duration::from_secs(30)).await;
    let mut c = connect(&[etcd.members[2].client_url()]).await;
    let got = c.get("/w/before", None).await.unwrap();
    assert_eq!(got.kvs().len(), 1);
}

/// `restore.rejoin_timeout` bounds the observe phase only: replication that outlasts it while it
/// progresses completes (here the timeout is shorter than one promotion retry, 2 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replication_may_outlast_rejoin_timeout_while_it_progresses() {
    logs();
    let mut etcd = EtcdCluster::start(3, Release::V35).await;
    let mut client = connect(&etcd.endpoints()[..2]).await;
    let value = vec![b'v'; 10_000];
    for i in 0..1000 {
        client
            .put(format!("/w/{i:04}"), value.clone(), None)
            .await
            .unwrap();
    }
    etcd.members[2].kill();
    let data = etcd.members[2].data_dir.clone();
    std::fs::remove_dir_all(&data).unwrap();
    // The stale voter removed beforehand: the observe phase is one learner addition.
    remove_m2(&client).await;
    // etcd refuses membership changes for 5 s after one ("unhealthy cluster").
    tokio::time::sleep(Duration::from_secs(6)).await;

    let timeout = Duration::from_secs(2);
    let config = restore_config(&etcd, 2, timeout);
    let begun = Instant::now();
    let rejoined = initialize(&config).await;
    assert!(matches!(rejoined, Ok(true)), "{rejoined:?}");
    tracing::info!(elapsed = ?begun.elapsed(), "rejoined");
    assert!(begun.elapsed() > timeout, "{:?}", begun.elapsed());
    assert!(is_valid_data_dir(&data));
    three_voters(&mut client).await;
}
