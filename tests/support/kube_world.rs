//! The world both Kubernetes scenario suites run in (`tests/operator_kube.rs` and
//! `tests/control_plane_set_kube.rs`): cp-0..cp-2 voting on loopback hosts, their Machines in the
//! API-server double, the platform that starts a learner's etcd where its Machine is, and the
//! operator's settings for all of it. Each suite adds what its scenarios need on top (a Machine
//! API, a provisioner, sets).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_warden::operator::kube::KubeMachinesConfig;
use etcd_warden::operator::kube::controller::Settings;
use etcd_warden::operator::kube::lease::LeaseTiming;
use etcd_warden::operator::kube::quorum_guard::QuorumGuard;
use etcd_warden::operator::quorum::execute::Timing;
use etcd_warden::operator::quorum::plan::{Replacement, Spec};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DynamicObject};
use tokio_util::sync::CancellationToken;

use super::apiserver::ApiServer;
use super::hosts::{Hosts, ip, members, platform};
use super::machine_api::{self, MachineApi, create_machine};

/// Where the Machines are.
pub const MACHINES_NS: &str = "openshift-machine-api";
/// Where the operator keeps its Lease, `etcd-endpoints`, the PDB and `EtcdQuorum`.
pub const ETCD_NS: &str = "openshift-etcd";

/// etcd on loopback hosts, the double holding their Machines, and the platform; everything it
/// started stops when it is dropped.
pub struct KubeWorld {
    pub hosts: Arc<Hosts>,
    /// IP → Machine name, for every Machine the test created.
    pub names: Arc<Mutex<BTreeMap<String, String>>>,
    pub server: ApiServer,
    /// A client with every right (the test's own).
    pub kc: kube::Client,
    /// The Machines, untyped.
    pub raw: Api<DynamicObject>,
    /// Cancelled on drop: the platform and whatever a suite spawned with it.
    pub stop: CancellationToken,
    _dir: tempfile::TempDir,
}

impl Drop for KubeWorld {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl KubeWorld {
    /// cp-0..cp-2 running etcd, each with its Machine (role `master`, its address), and the
    /// platform running. With `certs`, etcd's clients must present a certificate (mutual TLS):
    /// `certs` writes the CA, the server's certificate for the hosts' addresses and the
    /// clients' into the directory it is given.
    pub async fn start(certs: Option<fn(&Path, &[String])>) -> KubeWorld {
        let dir = tempfile::tempdir().unwrap();
        let tls = certs.map(|write| {
            let d = dir.path().join("pki");
            std::fs::create_dir_all(&d).unwrap();
            write(&d, &(0..8).map(ip).collect::<Vec<_>>());
            d
        });
        let hosts = Arc::new(Hosts::new(dir.path().to_path_buf(), tls));
        let first = hosts.start_cluster(3).await;
        let server = ApiServer::start().await;
        server.status_subresource("etcd-warden.io", "etcdquorums");
        server.status_subresource("etcd-warden.io", "controlplanesets");
        let kc = server.client();
        let raw = machine_api::machines(kc.clone(), MACHINES_NS);
        for (n, i) in &first {
            create_machine(&raw, n, "master", Some(i)).await;
        }
        let names: Arc<Mutex<BTreeMap<String, String>>> = Arc::new(Mutex::new(
            first.iter().map(|(n, i)| (i.clone(), n.clone())).collect(),
        ));
        let stop = CancellationToken::new();
        tokio::spawn(platform(
            Arc::clone(&hosts),
            Arc::clone(&names),
            stop.clone(),
        ));
        KubeWorld {
            hosts,
            names,
            server,
            kc,
            raw,
            stop,
            _dir: dir,
        }
    }

    /// Starts the Machine API: a deleting Machine goes once no pre-drain hook holds it, its
    /// etcd killed.
    pub fn machine_api(&self) -> MachineApi {
        MachineApi::start(self.raw.clone(), {
            let hosts = Arc::clone(&self.hosts);
            move |name| hosts.kill(name)
        })
    }

    /// The addresses of every Machine the test created.
    pub fn ips(&self) -> Vec<String> {
        self.names.lock().unwrap().keys().cloned().collect()
    }

    /// etcd's client URL on every Machine's address.
    pub fn client_urls(&self) -> Vec<String> {
        self.ips()
            .iter()
            .map(|i| self.hosts.client_url(i))
            .collect()
    }

    /// Every Event recorded in the Machines' namespace.
    pub async fn machine_events(&self) -> Vec<Event> {
        let events: Api<Event> = Api::namespaced(self.kc.clone(), MACHINES_NS);
        events.list(&Default::default()).await.unwrap().items
    }

    /// etcd's member list as (id, name, peer URL, learner), from any member that answers.
    pub async fn members(&self) -> Option<Vec<(u64, String, String, bool)>> {
        members(&self.hosts, &self.ips()).await
    }

    /// The operator's settings in this world: replica `identity`, 3 voters whose changes are
    /// ordered by `replacement`, and lease and retry timings short enough for a test.
    pub fn settings(&self, identity: &str, replacement: Replacement) -> Settings {
        Settings {
            spec: Spec {
                desired_voters: 3,
                replacement,
            },
            machines: KubeMachinesConfig {
                namespace: MACHINES_NS.into(),
                peer_scheme: "http".into(),
                peer_port: self.hosts.peer,
                ..KubeMachinesConfig::default()
            },
            etcd_endpoints: self.client_urls(),
            etcd_tls: None,
            namespace: ETCD_NS.into(),
            guard: QuorumGuard::default(),
            lease_name: "etcd-warden-operator".into(),
            identity: identity.into(),
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
            owner: None,
        }
    }
}
