//! `etcd::connect` against real etcd: TLS with client certificates (and a full snapshot streamed
//! over it), user/password authentication with the password in a file, and a client that keeps
//! working when etcd restarts and forgets its auth token.

use crate::support;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_warden::config::{EtcdConfig, Secret, TlsFiles};
use etcd_warden::etcd::RotatingClient;
use etcd_warden::etcd::process::{EtcdProcess, MemberSpec, ServerTls};
use etcd_warden::snapshot::take_full;
use etcd_warden::snapshot::watcher::DeltaWatch;
use etcd_warden::store::{Codec, SnapshotStore};
use support::etcd::{EtcdCluster, Release};
use support::tls::make_certs;

fn config(endpoint: String) -> EtcdConfig {
    support::etcd::plain_client_config(vec![endpoint], Duration::from_secs(5))
}

/// etcd 3.5 serving clients over TLS, requiring a client certificate; killed on drop.
struct TlsEtcd {
    _process: EtcdProcess,
    endpoint: String,
    ports: (u16, u16),
}

impl TlsEtcd {
    fn start(dir: &Path) -> TlsEtcd {
        Self::start_on(dir, 0, 0)
    }

    /// On given ports (0: chosen), so a restarted server keeps its endpoint; `dir` holds the
    /// certificates and the data directory `data`.
    fn start_on(dir: &Path, client: u16, peer: u16) -> TlsEtcd {
        let mut spec = MemberSpec {
            client_port: client,
            peer_port: peer,
            client_tls: Some(ServerTls {
                cert_file: dir.join("server.pem"),
                key_file: dir.join("server.key"),
                trusted_ca_file: Some(dir.join("ca.pem")),
                client_cert_auth: true,
            }),
            no_fsync: true,
            log_level: "error".into(),
            ..MemberSpec::new("tls", dir.join("data"))
        };
        let process = spec
            .spawn(Release::V35.binaries())
            .unwrap_or_else(|e| panic!("{e}"));
        TlsEtcd {
            _process: process,
            endpoint: spec.client_url(),
            ports: (spec.client_port, spec.peer_port),
        }
    }
}

fn tls(dir: &Path, with_client_cert: bool) -> TlsFiles {
    let p = |n: &str| Some(dir.join(n));
    TlsFiles {
        ca_file: p("ca.pem"),
        cert_file: if with_client_cert {
            p("client.pem")
        } else {
            None
        },
        key_file: if with_client_cert {
            p("client.key")
        } else {
            None
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    make_certs(dir.path());
    let etcd = TlsEtcd::start(dir.path());
    let mut cfg = config(etcd.endpoint.clone());
    cfg.tls = Some(tls(dir.path(), true));

    let deadline = Instant::now() + Duration::from_secs(15);
    let mut client = loop {
        if let Ok(mut c) = etcd_warden::etcd::connect(&cfg).await
            && c.put("k", "v", None).await.is_ok()
        {
            break c;
        }
        assert!(Instant::now() < deadline, "no TLS connection to etcd");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let got = client.get("k", None).await.unwrap();
    assert_eq!(got.kvs()[0].value(), b"v");

    // A full snapshot streams over the same TLS connection.
    let store_dir = tempfile::tempdir().unwrap();
    let backend =
        Arc::new(object_store::local::LocalFileSystem::new_with_prefix(store_dir.path()).unwrap());
    let store = SnapshotStore::new(backend, "");
    let snap = support::stored::gzip_full(&client, &store).await;
    assert_eq!(store.list().await.unwrap(), vec![snap]);

    // Without a client certificate the member refuses us.
    let mut no_cert = cfg.clone();
    no_cert.tls = Some(tls(dir.path(), false));
    let refused = match etcd_warden::etcd::connect(&no_cert).await {
        Err(_) => true,
        Ok(mut c) => c.put("k", "w", None).await.is_err(),
    };
    assert!(refused, "etcd accepted a client without a certificate");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_from_a_file() {
    let etcd = EtcdCluster::single(Release::V35).await;
    let mut admin = etcd.client().await;
    admin.user_add("root", "s3cret", None).await.unwrap();
    admin.user_grant_role("root", "root").await.unwrap();
    admin.auth_enable().await.unwrap();

    let dir = tempfile::tempdir().unwrap();
    let pw = dir.path().join("password");
    std::fs::write(&pw, "s3cret\n").unwrap();
    let mut cfg = config(etcd.endpoints()[0].clone());
    cfg.username = Some("root".into());
    cfg.password = Some(Secret::File(pw.clone()));
    let mut client = etcd_warden::etcd::connect(&cfg).await.unwrap();
    client.put("k", "v", None).await.unwrap();

    // The file is read at each connect: a rotated, wrong password is refused.
    std::fs::write(&pw, "wrong").unwrap();
    let refused = match etcd_warden::etcd::connect(&cfg).await {
        Err(_) => true,
        Ok(mut c) => c.put("k", "w", None).await.is_err(),
    };
    assert!(refused, "etcd accepted a wrong password");
}

/// A rotated CA and client certificate (the server restarted with certificates of a new CA) are
/// picked up by a long-lived client without a restart.
#[tokio::test]
async fn rotated_certificates_are_picked_up_without_a_restart() {
    let (old, new, live) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    make_certs(old.path());
    make_certs(new.path());
    let install = |from: &Path| {
        for f in ["ca.pem", "client.pem", "client.key"] {
            std::fs::copy(from.join(f), live.path().join(f)).unwrap();
        }
    };
    install(old.path());
    let mut etcd = TlsEtcd::start(old.path());
    let (cport, pport) = etcd.ports;
    let mut cfg = config(etcd.endpoint.clone());
    cfg.tls = Some(tls(live.path(), true));
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut rotating = loop {
        if let Ok(mut r) = etcd_warden::etcd::RotatingClient::connect(&cfg).await
            && r.client().await.put("k", "before", None).await.is_ok()
        {
            break r;
        }
        assert!(Instant::now() < deadline, "etcd with TLS did not come up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    // The server moves to a new CA; the old credentials no longer work against it.
    drop(etcd);
    std::fs::rename(old.path().join("data"), new.path().join("data")).unwrap();
    etcd = TlsEtcd::start_on(new.path(), cport, pport);
    let mut stale = etcd_warden::etcd::connect(&cfg).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        stale.put("k", "stale", None).await.is_err(),
        "old credentials must be refused by the new CA"
    );

    // New files land on disk (as a Secret update does); the same client object follows them.
    tokio::time::sleep(Duration::from_millis(20)).await;
    install(new.path());
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if rotating
            .client()
            .await
            .put("k", "after", None)
            .await
            .is_ok()
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "rotated certificates were not picked up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let got = rotating.client().await.get("k", None).await.unwrap();
    assert_eq!(got.kvs()[0].value(), b"after");
    drop(etcd);
}

/// Kills the one member and starts it again on its data, as the kubelet does after the sidecar
/// killed etcd. First waits for etcd to commit its database (every 100 ms): a token etcd handed
/// out since its last commit is handed out again as etcd replays its log, so it would survive.
async fn restart(etcd: &mut EtcdCluster) {
    tokio::time::sleep(Duration::from_millis(500)).await;
    etcd.members[0].kill();
    etcd.members[0].start();
    etcd.wait_healthy(Duration::from_secs(30)).await;
}

/// etcd forgets its (simple) auth tokens when it restarts. A long-lived client must authenticate
/// again for every call the sidecar makes, each tried as the first call after a restart: a watch
/// (the delta watcher reopens it after its stream broke; etcd refuses a stale token in the
/// watch's first response, not in the call), a full snapshot stream, status and a put.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_survives_an_etcd_restart() {
    let mut etcd = EtcdCluster::single(Release::V35).await;
    let mut admin = etcd.client().await;
    admin.user_add("root", "s3cret", None).await.unwrap();
    admin.user_grant_role("root", "root").await.unwrap();
    admin.auth_enable().await.unwrap();
    drop(admin);

    let dir = tempfile::tempdir().unwrap();
    let pw = dir.path().join("password");
    std::fs::write(&pw, "s3cret\n").unwrap();
    let mut cfg = config(etcd.endpoints()[0].clone());
    cfg.username = Some("root".into());
    cfg.password = Some(Secret::File(pw));
    let mut rotating = RotatingClient::connect(&cfg).await.unwrap();
    let put = rotating
        .client()
        .await
        .put("k", "before", None)
        .await
        .unwrap();
    let revision = put.header().unwrap().revision();

    restart(&mut etcd).await;
    let client = rotating.client().await;
    let mut watch = DeltaWatch::open(&client, revision + 1).await.unwrap();
    // Written by a client of its own, so that the watch is the only call made through `rotating`.
    etcd_warden::etcd::connect(&cfg)
        .await
        .unwrap()
        .put("k", "watched", None)
        .await
        .unwrap();
    let events = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let events = watch.next().await.expect("the watch after a restart");
            if !events.is_empty() {
                return events;
            }
        }
    })
    .await
    .expect("no event within 10s");
    assert_eq!(events.len(), 1, "{events:?}");

    restart(&mut etcd).await;
    let store_dir = tempfile::tempdir().unwrap();
    let backend =
        Arc::new(object_store::local::LocalFileSystem::new_with_prefix(store_dir.path()).unwrap());
    let store = SnapshotStore::new(backend, "");
    let snap = take_full(&rotating.client().await, &store, Codec::Gzip, false)
        .await
        .expect("a full snapshot after a restart");
    assert!(snap.last_revision > revision, "{snap:?}");

    restart(&mut etcd).await;
    rotating
        .client()
        .await
        .put("k", "after", None)
        .await
        .expect("a put after a restart");
    let status = rotating.client().await.status().await.unwrap();
    assert_ne!(status.leader(), 0);
}
