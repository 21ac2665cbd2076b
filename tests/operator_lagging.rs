//! A deletion hook is released only when a member list read after a linearizable read shows no
//! member on the machine; a lagging follower's own member list is not enough.
//!
//! Real etcd 3.5: members A, B and C, every peer URL a [`PeerProxy`] that can cut C off: every
//! connection to C, and every connection C opens (etcd's peer streams are dialled by the
//! receiving side and say who dialled in `X-Server-From`, so cutting only C's inbound traffic
//! would not stop A's messages reaching C). C keeps believing in its leader (a long election
//! timeout, so it neither campaigns nor forgets the leader) and answers member lists and status
//! from its own, frozen state: a healthy-looking follower that lags. A learner is then
//! added for machine X through A; C never hears of it. X is being deleted and carries the hook.
//! The operator, pointed at C only, plans from C's list ("no member on X": release the hook); the
//! release must not happen, because the list read after a linearizable read through the leader
//! shows X's learner.
//!
//! The Machines are an in-memory backend here: what is under test is the etcd side of the
//! decision; the Kubernetes backend's hook writes are tests/machines_conformance.rs's.

mod support;

use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_warden::operator::execute::{BackendError, Machines, Operator, Timing};
use etcd_warden::operator::plan::{Action, MachineState, Spec};
use support::etcd::Release;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A port free on `ip`.
fn port(ip: &str) -> u16 {
    std::net::TcpListener::bind((ip, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Which connections a [`PeerProxy`] cuts.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Cut {
    Nothing,
    /// Those whose first request says `X-Server-From: <id>` (hex, as etcd writes it).
    From(String),
    /// All.
    All,
}

/// A TCP proxy in front of one member's peer port that reads each connection's first HTTP
/// request head to learn which member opened it, and cuts connections per [`Cut`], open ones
/// included.
struct PeerProxy {
    addr: std::net::SocketAddr,
    cut: watch::Sender<Cut>,
}

impl PeerProxy {
    async fn start(ip: &str, target: std::net::SocketAddr) -> PeerProxy {
        let listener = TcpListener::bind((ip, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cut, _) = watch::channel(Cut::Nothing);
        let rx = cut.subscribe();
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(forward(conn, target, rx.clone()));
            }
        });
        PeerProxy { addr, cut }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Forwards one connection until the cut names it or either side closes.
async fn forward(
    mut inbound: TcpStream,
    target: std::net::SocketAddr,
    mut cut: watch::Receiver<Cut>,
) {
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 64 * 1024 {
        match inbound.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&head).to_lowercase();
    let from = text
        .lines()
        .find_map(|l| l.strip_prefix("x-server-from:"))
        .map(|v| v.trim().to_owned())
        .unwrap_or_default();
    let cuts = |c: &Cut| match c {
        Cut::Nothing => false,
        Cut::All => true,
        Cut::From(id) => *id == from,
    };
    if cuts(&cut.borrow_and_update()) {
        return;
    }
    let Ok(mut outbound) = TcpStream::connect(target).await else {
        return;
    };
    if outbound.write_all(&head).await.is_err() {
        return;
    }
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
        _ = cut.wait_for(|c| cuts(c)) => {}
    }
}

struct Procs(Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

struct Member {
    name: &'static str,
    client: String,
    listen_peer: String,
    advertise_peer: String,
}

fn start(dir: &std::path::Path, m: &Member, cluster: &str, extra: &[&str]) -> Child {
    let log = std::fs::File::create(dir.join(format!("{}.log", m.name))).unwrap();
    Command::new(Release::V35.bin("etcd"))
        .args(["--name", m.name])
        .arg("--data-dir")
        .arg(dir.join(m.name))
        .args(["--listen-peer-urls", &m.listen_peer])
        .args(["--initial-advertise-peer-urls", &m.advertise_peer])
        .args(["--listen-client-urls", &m.client])
        .args(["--advertise-client-urls", &m.client])
        .args(["--initial-cluster", cluster])
        .args(["--initial-cluster-state", "new"])
        .args(["--unsafe-no-fsync", "--log-level", "warn"])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("start etcd")
}

/// Machines kept in memory.
struct Fixed(Mutex<Vec<MachineState>>);

#[async_trait::async_trait]
impl Machines for Fixed {
    async fn list(&self) -> Result<Vec<MachineState>, BackendError> {
        Ok(self.0.lock().unwrap().clone())
    }
    async fn add_hook(&self, machine: &str) -> Result<(), BackendError> {
        let mut all = self.0.lock().unwrap();
        let m = all.iter_mut().find(|m| m.name == machine);
        m.ok_or_else(|| BackendError::NotFound(machine.into()))?
            .has_hook = true;
        Ok(())
    }
    async fn release_hook(&self, machine: &str) -> Result<(), BackendError> {
        let mut all = self.0.lock().unwrap();
        let m = all.iter_mut().find(|m| m.name == machine);
        m.ok_or_else(|| BackendError::NotFound(machine.into()))?
            .has_hook = false;
        Ok(())
    }
}

async fn member_peers(client_url: &str) -> Option<Vec<String>> {
    let mut c = etcd_client::Client::connect([client_url], None)
        .await
        .ok()?;
    let list = tokio::time::timeout(Duration::from_secs(2), c.member_list())
        .await
        .ok()?
        .ok()?;
    Some(
        list.members()
            .iter()
            .flat_map(|m| m.peer_urls().to_vec())
            .collect(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_followers_member_list_does_not_release_a_hook() {
    let dir = tempfile::tempdir().unwrap();
    // C's client URL sorts first, so the operator keeps asking C after its first observation.
    let (ip_c, ip_a, ip_b, ip_x) = ("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4");
    let url = |ip: &str| format!("http://{ip}:{}", port(ip));
    let mut proxies = Vec::new();
    let mut members = Vec::new();
    for (name, ip) in [("a", ip_a), ("b", ip_b), ("c", ip_c)] {
        let listen_peer = url(ip);
        let target = listen_peer.trim_start_matches("http://").parse().unwrap();
        let proxy = PeerProxy::start(ip, target).await;
        members.push(Member {
            name,
            client: url(ip),
            listen_peer,
            advertise_peer: proxy.url(),
        });
        proxies.push(proxy);
    }
    let cluster: Vec<String> = members
        .iter()
        .map(|m| format!("{}={}", m.name, m.advertise_peer))
        .collect();
    let cluster = cluster.join(",");
    let mut procs = Procs(Vec::new());
    for m in &members {
        // C neither campaigns nor forgets its leader while cut off (the limit is 50 s).
        // A and B accept a member add while C is unreachable (etcd refuses any add with a voter
        // disconnected unless told not to check).
        let extra: &[&str] = if m.name == "c" {
            &["--election-timeout", "50000"]
        } else {
            &["--strict-reconfig-check=false"]
        };
        procs.0.push(start(dir.path(), m, &cluster, extra));
    }
    let [a, _b, c] = &members[..] else {
        unreachable!()
    };
    for m in &members {
        let mut healthy = false;
        for _ in 0..100 {
            if support::etcd::member_healthy(&m.client).await {
                healthy = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(healthy, "{} did not become healthy", m.name);
    }

    // C is cut off both ways; then a learner for X is added through A.
    let mut ac = etcd_client::Client::connect([a.client.as_str()], None)
        .await
        .unwrap();
    let list = ac.member_list().await.unwrap();
    let c_id = list
        .members()
        .iter()
        .find(|m| m.name() == "c")
        .map(|m| format!("{:x}", m.id()))
        .expect("C's member ID");
    proxies[0].cut.send_replace(Cut::From(c_id.clone()));
    proxies[1].cut.send_replace(Cut::From(c_id));
    proxies[2].cut.send_replace(Cut::All);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let x_peer = url(ip_x);
    let mut added = false;
    for _ in 0..50 {
        let opts = etcd_client::MemberAddOptions::new().with_is_learner();
        match ac.member_add([x_peer.as_str()], Some(opts)).await {
            Ok(_) => {
                added = true;
                break;
            }
            Err(e) => eprintln!("member add: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(added, "the learner for X was not added");
    let on_a = member_peers(&a.client).await.expect("A's member list");
    assert!(on_a.contains(&x_peer), "A lists X: {on_a:?}");
    let on_c = member_peers(&c.client).await.expect("C's member list");
    assert!(!on_c.contains(&x_peer), "C must lag (not list X): {on_c:?}");

    let machine = |name: &str, peer: &str, deleting: bool| MachineState {
        name: name.into(),
        peer_url: peer.into(),
        deleting,
        has_hook: true,
        hook_removed_by_other: false,
    };
    let backend = Arc::new(Fixed(Mutex::new(vec![
        machine("a", &members[0].advertise_peer, false),
        machine("b", &members[1].advertise_peer, false),
        machine("c", &members[2].advertise_peer, false),
        machine("x", &x_peer, true),
    ])));
    let timing = Timing {
        interval: Duration::from_millis(100),
        min_backoff: Duration::from_millis(100),
        max_backoff: Duration::from_secs(1),
        request_timeout: Duration::from_secs(2),
    };
    let operator = Operator::new(
        Spec::new(3).unwrap(),
        Arc::clone(&backend),
        vec![c.client.clone()],
        timing,
    );
    let mut planned_release = 0;
    for _ in 0..5 {
        if let Ok(plan) = operator.step().await {
            planned_release += plan
                .actions
                .iter()
                .filter(|a| matches!(a, Action::ReleaseHook { machine } if machine == "x"))
                .count();
        }
        let hooked = backend
            .0
            .lock()
            .unwrap()
            .iter()
            .any(|m| m.name == "x" && m.has_hook);
        assert!(
            hooked,
            "X's hook released while X still has a member (C lags)"
        );
    }
    // Not vacuous: the stale list did lead the planner to the release.
    assert!(
        planned_release > 0,
        "the planner never saw C's stale list (no release planned)"
    );
}
