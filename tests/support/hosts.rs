//! etcd members on loopback "hosts" for the operator's Kubernetes tests: each member on its own
//! address (127.0.0.11, .12, …) with one peer and one client port, as members on separate hosts
//! are, so a Machine's InternalIP is all that names its member; the platform that starts a
//! learner's etcd where its Machine is; a writer and a member-list monitor.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions};
use tokio_util::sync::CancellationToken;

use etcd_warden::etcd::process::{Bootstrap, ClusterState, EtcdProcess, MemberSpec, ServerTls};

use super::etcd::Release;

pub fn ip(n: usize) -> String {
    format!("127.0.0.{}", 11 + n)
}

/// A port free on every address the test uses, and never handed to another test of this
/// process (they run in parallel).
pub fn common_port() -> u16 {
    static GIVEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    loop {
        let probe = std::net::TcpListener::bind("127.0.0.11:0").unwrap();
        let port = probe.local_addr().unwrap().port();
        drop(probe);
        let mut given = GIVEN.lock().unwrap();
        if !given.contains(&port)
            && (0..10).all(|n| std::net::TcpListener::bind((ip(n).as_str(), port)).is_ok())
        {
            given.push(port);
            return port;
        }
    }
}

/// etcd members on loopback "hosts", killed when dropped.
pub struct Hosts {
    pub dir: PathBuf,
    pub peer: u16,
    pub client: u16,
    pub running: Mutex<HashMap<String, EtcdProcess>>,
    /// Certificates (`ca.pem`, `server.*`, `client.*`) when clients must use mutual TLS.
    pub tls: Option<PathBuf>,
    /// While set, the platform starts no etcd for a learner (it stays added but unstarted).
    pub hold: std::sync::atomic::AtomicBool,
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for (_, member) in self.running.lock().unwrap().drain() {
            member.kill();
        }
    }
}

impl Hosts {
    /// Hosts whose data dirs and logs go under `dir`, on a fresh peer and client port; with
    /// `tls`, clients must present a certificate from that directory (mutual TLS).
    pub fn new(dir: PathBuf, tls: Option<PathBuf>) -> Hosts {
        Hosts {
            dir,
            peer: common_port(),
            client: common_port(),
            running: Mutex::new(HashMap::new()),
            tls,
            hold: Default::default(),
        }
    }

    /// Starts `n` members `cp-0`, `cp-1`, … on `ip(0)`, `ip(1)`, … as a new cluster and waits
    /// until every one has joined; returns each (name, address).
    pub async fn start_cluster(&self, n: usize) -> Vec<(String, String)> {
        let first: Vec<(String, String)> = (0..n).map(|i| (format!("cp-{i}"), ip(i))).collect();
        let initial: Vec<String> = first
            .iter()
            .map(|(name, i)| format!("{name}={}", self.peer_url(i)))
            .collect();
        for (name, i) in &first {
            self.start(name, i, &initial.join(","), "new");
        }
        let ips: Vec<String> = first.iter().map(|(_, i)| i.clone()).collect();
        eventually(
            "etcd to form its cluster",
            Duration::from_secs(30),
            async || {
                members(self, &ips)
                    .await
                    .filter(|m| m.iter().all(|m| !m.1.is_empty()))
            },
        )
        .await;
        first
    }

    pub fn peer_url(&self, ip: &str) -> String {
        format!("http://{ip}:{}", self.peer)
    }

    pub fn client_url(&self, ip: &str) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{ip}:{}", self.client)
    }

    pub fn start(&self, name: &str, ip: &str, initial_cluster: &str, state: &str) {
        let mut spec = MemberSpec {
            host: ip.parse().expect("a loopback host address"),
            client_port: self.client,
            peer_port: self.peer,
            bootstrap: Some(Bootstrap {
                initial_cluster: Some(initial_cluster.to_owned()),
                state: match state {
                    "new" => ClusterState::New,
                    _ => ClusterState::Existing,
                },
                token: "kube-e2e".into(),
            }),
            no_fsync: true,
            client_tls: self.tls.as_ref().map(|d| ServerTls {
                cert_file: d.join("server.pem"),
                key_file: d.join("server.key"),
                trusted_ca_file: Some(d.join("ca.pem")),
                client_cert_auth: true,
            }),
            log: Some(self.dir.join(format!("{name}.log"))),
            ..MemberSpec::new(name, self.dir.join(name))
        };
        let member = spec.spawn(Release::V35.binaries()).expect("start etcd");
        self.running.lock().unwrap().insert(name.to_owned(), member);
    }

    pub fn kill(&self, name: &str) {
        if let Some(member) = self.running.lock().unwrap().remove(name) {
            member.kill();
        }
    }

    pub fn is_running(&self, name: &str) -> bool {
        self.running.lock().unwrap().contains_key(name)
    }
}

pub async fn client(urls: &[String], tls: Option<&std::path::Path>) -> Option<Client> {
    let mut opts = ConnectOptions::new()
        .with_timeout(Duration::from_secs(2))
        .with_connect_timeout(Duration::from_secs(1));
    if let Some(d) = tls {
        let read = |f: &str| std::fs::read(d.join(f)).unwrap();
        opts = opts.with_tls(
            etcd_client::TlsOptions::new()
                .ca_certificate(etcd_client::Certificate::from_pem(read("ca.pem")))
                .identity(etcd_client::Identity::from_pem(
                    read("client.pem"),
                    read("client.key"),
                )),
        );
    }
    for u in urls {
        if let Ok(mut c) = Client::connect([u.as_str()], Some(opts.clone())).await
            && c.member_list().await.is_ok()
        {
            return Some(c);
        }
    }
    None
}

/// (id, name, peer URL, learner) of every member, through any member that answers.
pub async fn members(hosts: &Hosts, ips: &[String]) -> Option<Vec<(u64, String, String, bool)>> {
    let urls: Vec<String> = ips.iter().map(|i| hosts.client_url(i)).collect();
    let mut c = client(&urls, hosts.tls.as_deref()).await?;
    let list = c.member_list().await.ok()?;
    Some(
        list.members()
            .iter()
            .map(|m| {
                (
                    m.id(),
                    m.name().to_owned(),
                    m.peer_urls().first().cloned().unwrap_or_default(),
                    m.is_learner(),
                )
            })
            .collect(),
    )
}

pub async fn eventually<T>(
    what: &str,
    timeout: Duration,
    mut f: impl AsyncFnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The platform: a learner added for a Machine's address gets its etcd started there.
pub async fn platform(
    hosts: Arc<Hosts>,
    names: Arc<Mutex<BTreeMap<String, String>>>,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        let ips: Vec<String> = names.lock().unwrap().keys().cloned().collect();
        if let Some(list) = members(&hosts, &ips).await {
            for (_, _, peer, _) in list.iter().filter(|m| m.1.is_empty()) {
                let Some((ip, machine)) = names
                    .lock()
                    .unwrap()
                    .iter()
                    .find(|(ip, _)| hosts.peer_url(ip) == *peer)
                    .map(|(i, m)| (i.clone(), m.clone()))
                else {
                    continue;
                };
                if hosts.is_running(&machine)
                    || hosts.hold.load(std::sync::atomic::Ordering::SeqCst)
                {
                    continue;
                }
                let cluster: Vec<String> = list
                    .iter()
                    .map(|(_, n, p, _)| {
                        let n = if p == peer {
                            machine.clone()
                        } else {
                            n.clone()
                        };
                        format!("{n}={p}")
                    })
                    .filter(|s| !s.starts_with('='))
                    .collect();
                hosts.start(&machine, &ip, &cluster.join(","), "existing");
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[derive(Default, Debug)]
pub struct Writes {
    pub acked: BTreeMap<String, String>,
    pub errors: usize,
}

/// Puts keys through whichever member answers, for as long as it runs.
pub async fn writer(
    hosts: Arc<Hosts>,
    names: Arc<Mutex<BTreeMap<String, String>>>,
    stop: CancellationToken,
) -> Writes {
    let mut w = Writes::default();
    let mut c: Option<Client> = None;
    let mut i = 0u64;
    while !stop.is_cancelled() {
        if c.is_none() {
            let urls: Vec<String> = names
                .lock()
                .unwrap()
                .keys()
                .map(|ip| hosts.client_url(ip))
                .collect();
            c = client(&urls, hosts.tls.as_deref()).await;
        }
        let Some(cl) = c.as_mut() else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let (key, value) = (format!("w/{i:08}"), format!("v{i}"));
        i += 1;
        match cl.put(key.as_str(), value.as_str(), None).await {
            Ok(_) => {
                w.acked.insert(key, value);
            }
            Err(_) => {
                w.errors += 1;
                c = None;
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    w
}

/// Samples the member list: (min voters, max voters, max learners, samples).
pub async fn monitor(
    hosts: Arc<Hosts>,
    names: Arc<Mutex<BTreeMap<String, String>>>,
    stop: CancellationToken,
) -> (usize, usize, usize, usize) {
    let (mut min_v, mut max_v, mut max_l, mut n) = (usize::MAX, 0, 0, 0);
    while !stop.is_cancelled() {
        let ips: Vec<String> = names.lock().unwrap().keys().cloned().collect();
        if let Some(m) = members(&hosts, &ips).await {
            let voters = m.iter().filter(|m| !m.3).count();
            min_v = min_v.min(voters);
            max_v = max_v.max(voters);
            max_l = max_l.max(m.len() - voters);
            n += 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (min_v, max_v, max_l, n)
}

/// Every acknowledged write (key → value) is in etcd, read through `urls`.
pub async fn assert_writes_kept(
    urls: &[String],
    tls: Option<&std::path::Path>,
    acked: &BTreeMap<String, String>,
) {
    let mut c = client(urls, tls)
        .await
        .expect("a client for the final members");
    let got = c
        .get("w/", Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .expect("reading the writes back");
    let stored: BTreeMap<String, String> = got
        .kvs()
        .iter()
        .map(|kv| {
            (
                kv.key_str().unwrap().to_owned(),
                kv.value_str().unwrap().to_owned(),
            )
        })
        .collect();
    for (k, v) in acked {
        assert_eq!(stored.get(k), Some(v), "acknowledged write {k} lost");
    }
}

/// A writer and a member-list monitor running against the hosts until [`Load::finish`].
pub struct Load {
    stop: CancellationToken,
    writes: tokio::task::JoinHandle<Writes>,
    voters: tokio::task::JoinHandle<(usize, usize, usize, usize)>,
}

impl Load {
    /// Starts [`writer`] and [`monitor`] over the Machines in `names`.
    pub fn start(hosts: &Arc<Hosts>, names: &Arc<Mutex<BTreeMap<String, String>>>) -> Load {
        let stop = CancellationToken::new();
        Load {
            writes: tokio::spawn(writer(Arc::clone(hosts), Arc::clone(names), stop.clone())),
            voters: tokio::spawn(monitor(Arc::clone(hosts), Arc::clone(names), stop.clone())),
            stop,
        }
    }

    /// Cancelled by [`Load::finish`], for other samplers to stop with the load.
    pub fn token(&self) -> CancellationToken {
        self.stop.clone()
    }

    /// Stops both: the writes, and the monitor's (min voters, max voters, max learners, samples).
    pub async fn finish(self) -> (Writes, (usize, usize, usize, usize)) {
        self.stop.cancel();
        (
            self.writes.await.expect("the writer"),
            self.voters.await.expect("the monitor"),
        )
    }

    /// [`Load::finish`], checked: the monitor sampled more than 20 times and the member list
    /// stayed within `bounds`; more than 100 writes were acknowledged, and every one of them is
    /// still there, read through `urls`.
    pub async fn finish_within(self, bounds: Bounds, urls: &[String]) {
        let (writes, (min_v, max_v, max_l, samples)) = self.finish().await;
        assert!(samples > 20, "monitor sampled {samples} times");
        assert!(min_v >= bounds.min_voters, "voters fell to {min_v}");
        if let Some(most) = bounds.max_voters {
            assert!(max_v <= most, "voters rose to {max_v}");
        }
        if let Some(most) = bounds.max_learners {
            assert!(max_l <= most, "{max_l} learners at once");
        }
        assert!(
            writes.acked.len() > 100,
            "only {} writes acknowledged",
            writes.acked.len()
        );
        assert_writes_kept(urls, None, &writes.acked).await;
    }
}

/// What a [`Load`]'s monitor must have seen throughout: never fewer voters than `min_voters`,
/// and (when given) never more voters than `max_voters` or learners than `max_learners`.
pub struct Bounds {
    pub min_voters: usize,
    pub max_voters: Option<usize>,
    pub max_learners: Option<usize>,
}
