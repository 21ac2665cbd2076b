//! A lost member of a healthy 3-member etcd 3.5 rejoins as a learner, is promoted, and loses no
//! acknowledged write; the store is never read. A corrupt directory is moved aside; without
//! quorum nothing changes.

use crate::support;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use etcd_client::{
    Certificate, Client, ConnectOptions, GetOptions, Identity, MemberAddOptions, TlsOptions,
};
use etcd_warden::config::{EtcdConfig, PeerTls, RestoreConfig, TlsFiles};
use etcd_warden::etcd::process::ServerTls;
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
        peer_tls: None,
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

/// Certificates for 127.0.0.1 (`support::tls`): one serves every member on its client and its
/// peer URLs (client certificates required on both), and one is the sidecar's client's.
struct Certs {
    dir: tempfile::TempDir,
}

impl Certs {
    fn new() -> Certs {
        let dir = tempfile::tempdir().unwrap();
        support::tls::make_certs_for(dir.path(), &["127.0.0.1"], &["client"]);
        Certs { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The members' TLS, on client and peer URLs alike.
    fn member(&self) -> ServerTls {
        ServerTls {
            cert_file: self.path("server.pem"),
            key_file: self.path("server.key"),
            trusted_ca_file: Some(self.path("ca.pem")),
            client_cert_auth: true,
        }
    }

    /// `restore.peer_*`: the member's own peer certificate.
    fn peer(&self) -> PeerTls {
        PeerTls {
            cert_file: self.path("server.pem"),
            key_file: self.path("server.key"),
            ca_file: Some(self.path("ca.pem")),
            client_cert_auth: true,
        }
    }

    /// `etcd.ca_file`, `etcd.cert_file`, `etcd.key_file`.
    fn client(&self) -> TlsFiles {
        TlsFiles {
            ca_file: Some(self.path("ca.pem")),
            cert_file: Some(self.path("client.pem")),
            key_file: Some(self.path("client.key")),
        }
    }

    /// A client of `urls` with the client certificate.
    async fn connect<S: AsRef<str>>(&self, urls: &[S]) -> Client {
        let tls = TlsOptions::new()
            .ca_certificate(Certificate::from_pem(
                std::fs::read(self.path("ca.pem")).unwrap(),
            ))
            .identity(Identity::from_pem(
                std::fs::read(self.path("client.pem")).unwrap(),
                std::fs::read(self.path("client.key")).unwrap(),
            ));
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(10))
            .with_tls(tls);
        let urls: Vec<&str> = urls.iter().map(AsRef::as_ref).collect();
        Client::connect(urls, Some(opts)).await.unwrap()
    }
}

/// Keys `/w/000` to `/w/199`, written through `client`.
async fn write_keys(client: &mut Client) {
    for i in 0..200 {
        client
            .put(format!("/w/{i:03}"), format!("v{i}"), None)
            .await
            .unwrap();
    }
}

/// Three members with peer and client TLS (client certificates required on both), the keys
/// written, then m2 killed and its data directory wiped. Returns them, a client of the other
/// two, the membership before, and the restore section for m2 (the sidecar's client
/// certificate, no peer certificate yet).
async fn third_wiped_under_tls(
    release: Release,
    certs: &Certs,
) -> (EtcdCluster, Client, Vec<(String, u64, bool)>, RestoreConfig) {
    let mut etcd = EtcdCluster::start_with(3, release, Some(certs.member())).await;
    assert!(etcd.members[2].peer_url().starts_with("https://"));
    let mut client = certs.connect(&etcd.endpoints()[..2]).await;
    write_keys(&mut client).await;
    let mut before = members(&mut client).await;
    before.sort();
    etcd.members[2].kill();
    std::fs::remove_dir_all(&etcd.members[2].data_dir).unwrap();
    let mut config = restore_config(&etcd, 2, Duration::from_secs(120));
    config.etcd_bin = Some(release.bin_dir());
    if let Some(cluster) = config.cluster.as_mut() {
        cluster.tls = Some(certs.client());
    }
    (etcd, client, before, config)
}

/// m2 is a voter again: three voters; started with its own flags (peer TLS and all) it
/// serves every key on its own.
async fn m2_serves_every_key(etcd: &mut EtcdCluster, client: &mut Client, certs: &Certs) {
    let after = three_voters(client).await;
    assert_eq!(after.len(), 3, "{after:?}");
    assert!(is_valid_data_dir(&etcd.members[2].data_dir));
    let m2 = &mut etcd.members[2];
    m2.start();
    m2.wait_healthy(Duration::from_secs(30)).await;
    let mut c = certs.connect(&[m2.client_url()]).await;
    let status = c.status().await.unwrap();
    assert!(!status.is_learner());
    let got = c
        .get(
            "/w/",
            Some(GetOptions::new().with_prefix().with_serializable()),
        )
        .await
        .unwrap();
    let values: Vec<String> = got
        .kvs()
        .iter()
        .map(|kv| kv.value_str().unwrap().to_owned())
        .collect();
    let want: Vec<String> = (0..200).map(|i| format!("v{i}")).collect();
    assert_eq!(values, want);
}

/// A lost member of a cluster with peer TLS rejoins as a learner with its peer certificate
/// (`restore.peer_*`) and the sidecar's client certificate (`[etcd]`'s TLS files); before,
/// without a peer certificate, the attempt is refused naming the key, and the membership is
/// left as it was.
async fn rejoins_under_peer_tls(release: Release) {
    logs();
    let certs = Certs::new();
    let (mut etcd, mut client, before, mut config) = third_wiped_under_tls(release, &certs).await;

    let e = initialize(&config).await.unwrap_err();
    assert!(matches!(e, RejoinError::PeerTls(_)), "{e}");
    assert!(e.to_string().contains("restore.peer_cert_file"), "{e}");
    let mut unchanged = members(&mut client).await;
    unchanged.sort();
    assert_eq!(unchanged, before, "membership changed by a refused rejoin");

    config.peer_tls = Some(certs.peer());
    assert!(initialize(&config).await.unwrap(), "not rejoined");
    m2_serves_every_key(&mut etcd, &mut client, &certs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_member_rejoins_under_peer_tls_on_etcd_3_5() {
    rejoins_under_peer_tls(Release::V35).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_member_rejoins_under_peer_tls_on_etcd_3_4() {
    rejoins_under_peer_tls(Release::V34).await;
}

/// The druid profile: etcd-wrapper's `/initialization/start` on a member whose etcd
/// configuration file (as druid writes it) has `peer-transport-security`: the rejoin takes the
/// member's name, peer URLs, data directory and peer certificate from that file, the sidecar's
/// own restore section having none of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_druid_a_wiped_member_rejoins_with_the_peer_tls_of_etcds_configuration() {
    use axum::body::Body;
    use axum::extract::ConnectInfo;
    use axum::http::Request;
    use etcd_warden::config::DruidConfig;
    use etcd_warden::druid::{Druid, routes};
    use etcd_warden::server::PodCallers;
    use tower::ServiceExt;

    logs();
    let certs = Certs::new();
    let (mut etcd, mut client, _, mut restore) = third_wiped_under_tls(Release::V35, &certs).await;
    let m2 = &etcd.members[2];
    let conf = etcd.dir.path().join("etcd.conf.yaml");
    let path = |n: &str| certs.path(n).display().to_string();
    std::fs::write(
        &conf,
        format!(
            "name: etcd-config\n\
             data-dir: {data}\n\
             initial-cluster-token: etcd-cluster\n\
             initial-cluster-state: new\n\
             initial-cluster: {cluster}\n\
             initial-advertise-peer-urls:\n  m2:\n  - {peer}\n\
             advertise-client-urls:\n  m2:\n  - {client}\n\
             client-transport-security:\n  cert-file: {cert}\n  key-file: {key}\n  \
               client-cert-auth: true\n  trusted-ca-file: {ca}\n  auto-tls: false\n\
             peer-transport-security:\n  cert-file: {cert}\n  key-file: {key}\n  \
               client-cert-auth: true\n  trusted-ca-file: {ca}\n  auto-tls: false\n",
            data = m2.data_dir.display(),
            cluster = initial_cluster(&etcd),
            peer = m2.peer_url(),
            client = m2.client_url(),
            cert = path("server.pem"),
            key = path("server.key"),
            ca = path("ca.pem"),
        ),
    )
    .unwrap();
    // What the sidecar's own configuration says under druid: etcd-backup-restore's defaults.
    restore.name = "default".into();
    restore.initial_advertise_peer_urls = "http://localhost:2380".into();
    restore.initial_cluster = String::new();
    restore.data_dir = None;
    let druid = Druid::new(
        DruidConfig::without_leases(conf, "m2"),
        restore,
        empty_store(),
        None,
        InitializeMetrics::default(),
        CancellationToken::new(),
    );
    let get = |path: &str| {
        let mut req = Request::get(path).body(Body::empty()).unwrap();
        req.extensions_mut().insert(ConnectInfo(
            "127.0.0.1:40000".parse::<std::net::SocketAddr>().unwrap(),
        ));
        let router = routes(druid.clone(), PodCallers { token: None });
        async move {
            let resp = router.oneshot(req).await.unwrap();
            let code = resp.status();
            let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
                .await
                .unwrap();
            (code.as_u16(), String::from_utf8_lossy(&body).into_owned())
        }
    };
    assert_eq!(get("/initialization/start?mode=sanity").await.0, 200);
    let deadline = Instant::now() + Duration::from_secs(150);
    loop {
        let (code, body) = get("/initialization/status").await;
        assert_eq!(code, 200);
        match body.as_str() {
            "Successful" => break,
            "Progress" => {}
            other => panic!("initialization ended {other}"),
        }
        assert!(Instant::now() < deadline, "initialization still running");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    m2_serves_every_key(&mut etcd, &mut client, &certs).await;
}
