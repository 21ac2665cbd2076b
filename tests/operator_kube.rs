//! The operator's Kubernetes controller (`operator::kube::controller::run`, in process) against
//! the API server double and a real 3-member etcd 3.5: the test plays the Machine API
//! (`support::machine_api`: a deleting Machine goes once no pre-drain hook holds it, its etcd
//! killed) and the platform (a learner added for a Machine gets its etcd started there).
//!
//! Every member runs on its own loopback address (127.0.0.11, .12, …) on one peer and one client
//! port, as members on separate hosts do, so a Machine's InternalIP is all that names its member.

mod support;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions};
use etcd_warden::operator::execute::Timing;
use etcd_warden::operator::kube::KubeMachinesConfig;
use etcd_warden::operator::kube::controller::{self, Settings};
use etcd_warden::operator::kube::lease::LeaseTiming;
use etcd_warden::operator::kube::quorum_guard::QuorumGuard;
use etcd_warden::operator::plan::Spec;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams};
use support::apiserver::ApiServer;
use support::etcd::Release;
use support::machine_api::{self, MachineApi, create_machine, pre_drain};
use tokio_util::sync::CancellationToken;

const MACHINES_NS: &str = "openshift-machine-api";
const ETCD_NS: &str = "openshift-etcd";

fn ip(n: usize) -> String {
    format!("127.0.0.{}", 11 + n)
}

/// A port free on every address the test uses.
fn common_port() -> u16 {
    loop {
        let probe = std::net::TcpListener::bind("127.0.0.11:0").unwrap();
        let port = probe.local_addr().unwrap().port();
        drop(probe);
        if (0..8).all(|n| std::net::TcpListener::bind((ip(n).as_str(), port)).is_ok()) {
            return port;
        }
    }
}

/// etcd members on loopback "hosts", killed when dropped.
struct Hosts {
    dir: PathBuf,
    peer: u16,
    client: u16,
    running: Mutex<HashMap<String, Child>>,
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for (_, mut c) in self.running.lock().unwrap().drain() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Hosts {
    fn peer_url(&self, ip: &str) -> String {
        format!("http://{ip}:{}", self.peer)
    }

    fn client_url(&self, ip: &str) -> String {
        format!("http://{ip}:{}", self.client)
    }

    fn start(&self, name: &str, ip: &str, initial_cluster: &str, state: &str) {
        let log = std::fs::File::create(self.dir.join(format!("{name}.log"))).unwrap();
        let child = Command::new(Release::V35.bin("etcd"))
            .args(["--name", name])
            .arg("--data-dir")
            .arg(self.dir.join(name))
            .args(["--listen-peer-urls", &self.peer_url(ip)])
            .args(["--initial-advertise-peer-urls", &self.peer_url(ip)])
            .args(["--listen-client-urls", &self.client_url(ip)])
            .args(["--advertise-client-urls", &self.client_url(ip)])
            .args(["--initial-cluster", initial_cluster])
            .args(["--initial-cluster-state", state])
            .args(["--initial-cluster-token", "kube-e2e"])
            .args(["--unsafe-no-fsync", "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start etcd");
        self.running.lock().unwrap().insert(name.to_owned(), child);
    }

    fn kill(&self, name: &str) {
        if let Some(mut c) = self.running.lock().unwrap().remove(name) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn is_running(&self, name: &str) -> bool {
        self.running.lock().unwrap().contains_key(name)
    }
}

async fn client(urls: &[String]) -> Option<Client> {
    let opts = ConnectOptions::new()
        .with_timeout(Duration::from_secs(2))
        .with_connect_timeout(Duration::from_secs(1));
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
async fn members(hosts: &Hosts, ips: &[String]) -> Option<Vec<(u64, String, String, bool)>> {
    let urls: Vec<String> = ips.iter().map(|i| hosts.client_url(i)).collect();
    let mut c = client(&urls).await?;
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

async fn eventually<T>(what: &str, timeout: Duration, mut f: impl AsyncFnMut() -> Option<T>) -> T {
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
async fn platform(
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
                if hosts.is_running(&machine) {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_replaces_a_member_through_machines_hooks_and_learners() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = Arc::new(Hosts {
        dir: dir.path().to_path_buf(),
        peer: common_port(),
        client: common_port(),
        running: Mutex::new(HashMap::new()),
    });
    let first: Vec<(String, String)> = (0..3).map(|n| (format!("cp-{n}"), ip(n))).collect();
    let initial: Vec<String> = first
        .iter()
        .map(|(n, i)| format!("{n}={}", hosts.peer_url(i)))
        .collect();
    for (n, i) in &first {
        hosts.start(n, i, &initial.join(","), "new");
    }
    let names: Arc<Mutex<BTreeMap<String, String>>> = Arc::new(Mutex::new(
        first.iter().map(|(n, i)| (i.clone(), n.clone())).collect(),
    ));
    let ips: Vec<String> = first.iter().map(|(_, i)| i.clone()).collect();
    eventually(
        "etcd to form its cluster",
        Duration::from_secs(30),
        async || {
            members(&hosts, &ips)
                .await
                .filter(|m| m.iter().all(|m| !m.1.is_empty()))
        },
    )
    .await;

    let server = ApiServer::start().await;
    let kc = server.client();
    let raw = machine_api::machines(kc.clone(), MACHINES_NS);
    for (n, i) in &first {
        create_machine(&raw, n, "master", Some(i)).await;
    }
    let _machine_api = MachineApi::start(raw.clone(), {
        let hosts = Arc::clone(&hosts);
        move |name| hosts.kill(name)
    });
    let stop = CancellationToken::new();
    let platform_task = tokio::spawn(platform(
        Arc::clone(&hosts),
        Arc::clone(&names),
        stop.clone(),
    ));

    let settings = Settings {
        spec: Spec::new(3).unwrap(),
        machines: KubeMachinesConfig {
            namespace: MACHINES_NS.into(),
            peer_scheme: "http".into(),
            peer_port: hosts.peer,
            ..KubeMachinesConfig::default()
        },
        etcd_endpoints: ips.iter().map(|i| hosts.client_url(i)).collect(),
        namespace: ETCD_NS.into(),
        guard: QuorumGuard::default(),
        lease_name: "etcd-warden-operator".into(),
        identity: "op-0".into(),
        lease: LeaseTiming {
            duration: Duration::from_secs(2),
            renew_deadline: Duration::from_millis(1500),
            retry: Duration::from_millis(200),
        },
        timing: Timing {
            interval: Duration::from_millis(200),
            min_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
            request_timeout: Duration::from_secs(2),
        },
    };
    let cancel = CancellationToken::new();
    let ctl = tokio::spawn(controller::run(kc.clone(), settings, cancel.clone()));

    // Every member's Machine protected; the PDB for 3 machines.
    eventually(
        "hooks on every machine",
        Duration::from_secs(20),
        async || {
            let all = futures::future::join_all(first.iter().map(|(n, _)| raw.get(n))).await;
            all.iter()
                .all(|m| m.as_ref().is_ok_and(|m| pre_drain(m).len() == 1))
                .then_some(())
        },
    )
    .await;
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(kc.clone(), ETCD_NS);
    let min = |p: &PodDisruptionBudget| p.spec.as_ref().and_then(|s| s.min_available.clone());
    eventually("the PDB", Duration::from_secs(10), async || {
        let p = budgets.get_opt("etcd-guard-pdb").await.ok().flatten()?;
        (min(&p) == Some(IntOrString::Int(2))).then_some(())
    })
    .await;

    // Replace cp-0: a new Machine at a new address, the old one deleted.
    names.lock().unwrap().insert(ip(3), "cp-3".into());
    create_machine(&raw, "cp-3", "master", Some(&ip(3))).await;
    raw.delete("cp-0", &DeleteParams::default()).await.unwrap();

    let all_ips: Vec<String> = (0..4).map(ip).collect();
    let done = eventually(
        "cp-0 replaced by cp-3",
        Duration::from_secs(60),
        async || {
            let m = members(&hosts, &all_ips).await?;
            let mut voters: Vec<String> = m.iter().filter(|m| !m.3).map(|m| m.1.clone()).collect();
            voters.sort();
            let gone = raw.get_opt("cp-0").await.ok()?.is_none();
            (voters == ["cp-1", "cp-2", "cp-3"] && m.len() == 3 && gone).then_some(m)
        },
    )
    .await;
    assert!(!hosts.is_running("cp-0"), "the Machine API terminated cp-0");

    // etcd-endpoints: one key per member, its hex ID, its IP.
    let cms: Api<ConfigMap> = Api::namespaced(kc.clone(), ETCD_NS);
    let want: BTreeMap<String, String> = done
        .iter()
        .map(|(id, _, peer, _)| {
            let ip = peer
                .trim_start_matches("http://")
                .split(':')
                .next()
                .unwrap();
            (format!("{id:x}"), ip.to_owned())
        })
        .collect();
    eventually(
        "the endpoints ConfigMap",
        Duration::from_secs(10),
        async || {
            let cm = cms.get_opt("etcd-endpoints").await.ok().flatten()?;
            (cm.data.unwrap_or_default() == want).then_some(())
        },
    )
    .await;
    let p = budgets.get("etcd-guard-pdb").await.unwrap();
    assert_eq!(min(&p), Some(IntOrString::Int(2)), "back to 3 machines");

    // Events tell the story on the Machines.
    let events: Api<Event> = Api::namespaced(kc.clone(), MACHINES_NS);
    let reasons: Vec<String> = events
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|e| e.reason)
        .collect();
    for r in [
        "DeletionHookAdded",
        "LearnerAdded",
        "LearnerPromoted",
        "MemberRemoved",
        "DeletionHookReleased",
    ] {
        assert!(
            reasons.iter().any(|x| x == r),
            "no {r} event in {reasons:?}"
        );
    }

    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(10), ctl)
        .await
        .expect("the controller stops")
        .unwrap();
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(kc, ETCD_NS);
    let lease = leases.get("etcd-warden-operator").await.unwrap();
    assert_eq!(
        lease.spec.unwrap().holder_identity,
        None,
        "released on shutdown"
    );
    stop.cancel();
    platform_task.await.unwrap();
}
