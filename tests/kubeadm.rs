//! kubeadm's stacked etcd, as deploy/kubeadm backs it up: three members over mutual TLS (client
//! and peer certificates required) with the certificates kubeadm writes (`scripts/kubeadm-pki`:
//! an etcd CA per cluster, per node `server`, `peer` and `healthcheck-client` in RSA PKCS#1),
//! and an `etcd-warden serve` per member run as a plain process, as the DaemonSet's pod runs on
//! each control-plane node: its own member's client URL, the node's `healthcheck-client`
//! certificate, no `[owner]` section, no PID namespace to share. Only the raft leader's sidecar
//! stores fulls and deltas; when the leader's etcd is killed the new leader's sidecar continues
//! the chain without a gap (the former leader's retrying its watch at most once a second until
//! it sees it no longer leads); and `restore --bump-revision --mark-compacted`, as docs/kubeadm.md
//! restores a control plane, gives back every key at its revisions.

use crate::restore::{Dump, dump, dump_at};
use crate::support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use etcd_warden::etcd::process::{
    self, Bootstrap, ClusterState, EtcdProcess, MemberSpec, ServerTls,
};
use etcd_warden::store::{Kind, Snapshot};
use support::etcd::Release;
use support::eventually;
use support::warden::Warden;

/// What `restore` adds to the revision, as Kubernetes' restore procedure bumps it.
const BUMP: i64 = 1_000_000_000;

/// One control-plane node: the directory standing for its /etc/kubernetes.
struct Node {
    name: String,
    kubernetes: PathBuf,
}

impl Node {
    fn etcd_pki(&self, file: &str) -> PathBuf {
        self.kubernetes.join("pki/etcd").join(file)
    }

    /// The flags kubeadm's static pod manifest gives etcd: `--cert-file`, `--key-file`,
    /// `--trusted-ca-file`, `--client-cert-auth=true` and the same four `--peer-*`.
    fn server_tls(&self, kind: &str) -> ServerTls {
        ServerTls {
            cert_file: self.etcd_pki(&format!("{kind}.crt")),
            key_file: self.etcd_pki(&format!("{kind}.key")),
            trusted_ca_file: Some(self.etcd_pki("ca.crt")),
            client_cert_auth: true,
        }
    }
}

/// `scripts/kubeadm-pki` for nodes `cp-0`..: the first makes the CA, the others copy it.
fn kubeadm_nodes(dir: &Path, n: usize) -> Vec<Node> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/kubeadm-pki");
    let nodes: Vec<Node> = (0..n)
        .map(|i| Node {
            name: format!("cp-{i}"),
            kubernetes: dir.join(format!("cp-{i}/etc/kubernetes")),
        })
        .collect();
    for (i, node) in nodes.iter().enumerate() {
        let mut cmd = std::process::Command::new("bash");
        cmd.arg(&script)
            .arg(&node.kubernetes)
            .arg(&node.name)
            .arg("127.0.0.1");
        if i > 0 {
            cmd.arg(&nodes[0].kubernetes);
        }
        support::cli::succeeds(&mut cmd);
    }
    nodes
}

/// A client as kube-apiserver connects: the etcd CA and `apiserver-etcd-client`.
async fn apiserver_client(node: &Node, endpoints: Vec<String>) -> etcd_client::Client {
    let read = |p: PathBuf| std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let tls = etcd_client::TlsOptions::new()
        .ca_certificate(etcd_client::Certificate::from_pem(read(
            node.etcd_pki("ca.crt"),
        )))
        .identity(etcd_client::Identity::from_pem(
            read(node.kubernetes.join("pki/apiserver-etcd-client.crt")),
            read(node.kubernetes.join("pki/apiserver-etcd-client.key")),
        ));
    let opts = etcd_client::ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_timeout(Duration::from_secs(5))
        .with_tls(tls);
    etcd_client::Client::connect(endpoints, Some(opts))
        .await
        .expect("connect to etcd with apiserver-etcd-client")
}

/// Puts (one large), overwrites and a delete under `/registry/<tag>/`, as an apiserver writes;
/// a write refused while leadership moves is retried. Returns the revision after them.
async fn writes(client: &mut etcd_client::Client, tag: &str) -> i64 {
    let mut rev = 0;
    for i in 0..40 {
        let (key, value) = match i {
            30 => (format!("/registry/{tag}/k00"), b"overwritten".to_vec()),
            31 => (format!("/registry/{tag}/big"), vec![b'x'; 100 * 1024]),
            _ => (
                format!("/registry/{tag}/k{i:02}"),
                format!("v{i}").into_bytes(),
            ),
        };
        rev = retry(|| {
            let (mut c, key, value) = (client.clone(), key.clone(), value.clone());
            async move {
                c.put(key, value, None)
                    .await
                    .map(|r| r.header().map_or(0, |h| h.revision()))
            }
        })
        .await;
    }
    let key = format!("/registry/{tag}/k01");
    retry(|| {
        let (mut c, key) = (client.clone(), key.clone());
        async move {
            c.delete(key, None)
                .await
                .map(|r| r.header().map_or(0, |h| h.revision()))
        }
    })
    .await
    .max(rev)
}

/// `f` until it succeeds, for up to 15 s (an election after the leader's kill takes about 1 s).
async fn retry<F, Fut>(mut f: F) -> i64
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<i64, etcd_client::Error>>,
{
    let start = std::time::Instant::now();
    loop {
        match f().await {
            Ok(r) => return r,
            Err(e) if start.elapsed() > Duration::from_secs(15) => panic!("etcd write: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// How many snapshots each sidecar's log says it stored (full, delta).
fn stored(wardens: &[Warden]) -> Vec<(usize, usize)> {
    wardens
        .iter()
        .map(|w| {
            let log = w.log_text();
            (
                log.matches("full snapshot stored").count(),
                log.matches("delta snapshot stored").count(),
            )
        })
        .collect()
}

/// The index in `urls` of the member raft says leads, asked through `client`.
async fn raft_leader(client: &mut etcd_client::Client, urls: &[String]) -> Option<usize> {
    let id = client.status().await.ok()?.leader();
    let list = client.member_list().await.ok()?;
    let leader = list.members().iter().find(|m| m.id() == id)?;
    urls.iter()
        .position(|u| leader.client_urls().iter().any(|c| c == u))
}

/// The deltas after the last full continue it without a gap and end at `revision`.
fn chain_problem(list: &[Snapshot], revision: i64) -> Option<String> {
    let Some(full) = list.iter().rposition(|s| s.kind == Kind::Full) else {
        return Some(format!("no full snapshot: {list:?}"));
    };
    let mut last = list[full].last_revision;
    for d in &list[full + 1..] {
        if d.start_revision != last + 1 {
            return Some(format!("gap before {}: {list:?}", d.snap_name));
        }
        last = d.last_revision;
    }
    (last != revision).then(|| format!("the chain ends at {last}, not {revision}: {list:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubeadm_stacked_etcd_is_backed_up_by_the_leaders_node_through_a_failover_and_restored() {
    let started = std::time::Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let nodes = kubeadm_nodes(dir.path(), 3);

    // The members as kubeadm's static pods run them (--data-dir /var/lib/etcd stands here as
    // <node>/var/lib/etcd).
    let mut specs: Vec<MemberSpec> = nodes
        .iter()
        .map(|n| MemberSpec {
            bootstrap: Some(Bootstrap {
                initial_cluster: None,
                state: ClusterState::New,
                token: format!("kubeadm-{}", std::process::id()),
            }),
            no_fsync: true,
            log: Some(dir.path().join(format!("{}.etcd.log", n.name))),
            client_tls: Some(n.server_tls("server")),
            peer_tls: Some(n.server_tls("peer")),
            ..MemberSpec::new(&n.name, n.kubernetes.join("../../var/lib/etcd"))
        })
        .collect();
    let release = Release::V35;
    let mut members: Vec<Option<EtcdProcess>> =
        process::start_cluster(release.binaries(), &mut specs, Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("kubeadm-shaped etcd did not start: {e}"))
            .into_iter()
            .map(Some)
            .collect();
    let urls: Vec<String> = specs.iter().map(MemberSpec::client_url).collect();
    assert!(urls.iter().all(|u| u.starts_with("https://")), "{urls:?}");

    // A sidecar per node, as deploy/kubeadm/config.toml configures it.
    let store_dir = dir.path().join("store");
    let store_url = format!("file://{}", store_dir.display());
    let wardens: Vec<Warden> = nodes
        .iter()
        .zip(&urls)
        .map(|(n, url)| {
            let file = |f: &str| n.etcd_pki(f).display().to_string();
            Warden::start(&[
                ("etcd.endpoints", url.clone()),
                ("etcd.ca_file", file("ca.crt")),
                ("etcd.cert_file", file("healthcheck-client.crt")),
                ("etcd.key_file", file("healthcheck-client.key")),
                ("store.url", store_url.clone()),
                ("snapshot.delta_period", "300ms".into()),
                // Long enough to see what the leader's sidecar does between its etcd's death
                // and its next leadership check.
                ("snapshot.leader_check_interval", "10s".into()),
            ])
        })
        .collect();
    for w in &wardens {
        w.wait_up().await;
    }
    let store = support::file_store(&store_dir);
    let reached = |r: i64| support::stored::newest_at(store.clone(), r);

    // Before the failover: the raft leader's sidecar, and only it, stores fulls and deltas.
    let mut client = apiserver_client(&nodes[0], urls.clone()).await;
    let rev = writes(&mut client, "before").await;
    assert!(
        eventually(Duration::from_secs(15), || reached(rev)).await,
        "the store reaches revision {rev}: {:?}; logs:\n{}",
        store.list().await,
        wardens
            .iter()
            .map(Warden::log_text)
            .collect::<Vec<_>>()
            .join("\n---\n")
    );
    let leaders = crate::support::warden::snapshot_leaders(&wardens).await;
    let first = raft_leader(&mut client, &urls)
        .await
        .expect("a raft leader");
    assert_eq!(leaders, vec![first], "only the raft leader's sidecar leads");
    let before = stored(&wardens);
    for (i, (fulls, deltas)) in before.iter().enumerate() {
        if i == first {
            assert!(*fulls >= 1 && *deltas >= 1, "leader {i} stored {before:?}");
        } else {
            assert_eq!((*fulls, *deltas), (0, 0), "follower {i} stored: {before:?}");
        }
    }

    // The leader's etcd dies (its node fails): another member leads and its node's sidecar
    // continues the chain.
    members[first].take().expect("running").kill();
    let survivors: Vec<String> = urls
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != first)
        .map(|(_, u)| u.clone())
        .collect();
    let mut client = apiserver_client(&nodes[0], survivors.clone()).await;
    let rev = writes(&mut client, "after").await;
    assert!(
        eventually(Duration::from_secs(30), || reached(rev)).await,
        "the new leader's sidecar reaches revision {rev}: {:?}",
        store.list().await
    );
    let list = store.list().await.unwrap();
    assert_eq!(chain_problem(&list, rev), None);
    // Until its next leadership check (up to 10 s later) the former leader's sidecar retries
    // its watch once a second (WATCH_RETRY), not in a busy loop (it once logged a warning every
    // few ms). When the check happens to come within a second of the kill there is no retry at
    // all and this cannot fail; with a 10 s interval that is one run in ten.
    let former = &wardens[first];
    assert!(
        eventually(Duration::from_secs(15), || async {
            former.log_text().contains("snapshot leadership lost")
        })
        .await,
        "the former leader's sidecar gives up leadership:\n{}",
        former.log_text()
    );
    let retries = former
        .log_text()
        .matches("cannot start watching etcd for deltas")
        .count();
    assert!(
        retries <= 12,
        "{retries} failed watch starts within one 10 s leadership check:\n{}",
        former.log_text()
    );
    let second = raft_leader(&mut client, &urls)
        .await
        .expect("a new raft leader");
    assert_ne!(second, first);
    assert_eq!(
        crate::support::warden::snapshot_leaders(&wardens).await,
        vec![second]
    );
    let after = stored(&wardens);
    for i in 0..wardens.len() {
        let gained = (after[i].0 - before[i].0, after[i].1 - before[i].1);
        if i == second {
            assert!(
                gained.1 >= 1,
                "new leader {i} stored no delta: {before:?} → {after:?}"
            );
        } else {
            assert_eq!(gained, (0, 0), "sidecar {i} stored: {before:?} → {after:?}");
        }
    }

    // The restore of the control plane (docs/kubeadm.md): every key at its revisions, etcd
    // starting a billion revisions on and compacted there.
    let source: Dump = dump_at(&mut client, Some(rev)).await;
    let restored_dir = dir.path().join("restored/var/lib/etcd");
    std::fs::create_dir_all(restored_dir.parent().unwrap()).unwrap();
    let out = support::cli::succeeds(
        support::warden::command()
            .args(["restore", "--store", &store_url, "--data-dir"])
            .arg(&restored_dir)
            .arg("--etcd-bin")
            .arg(release.bin_dir())
            .args(["--bump-revision", &BUMP.to_string(), "--mark-compacted"]),
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        printed.contains(&format!("etcd starts at revision {}", rev + BUMP)),
        "{printed}"
    );
    let temp = support::etcd::temp_etcd(
        release,
        &restored_dir,
        "default",
        dir.path().join("restored.log"),
    )
    .await
    .expect("etcd starts on the restored directory");
    let mut c = etcd_client::Client::connect([&temp.client_url], None)
        .await
        .unwrap();
    let restored = dump(&mut c).await;
    assert_eq!(restored.1, rev + BUMP, "the restored revision");
    assert_eq!(restored.0.len(), source.0.len());
    assert!(
        restored.0 == source.0,
        "the restored keys differ from the source's at revision {rev}"
    );
    temp.stop().await.unwrap();
    drop(members);
    eprintln!("kubeadm: {:.1}s", started.elapsed().as_secs_f64());
}
