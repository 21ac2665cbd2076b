//! The operator's Kubernetes controller (`operator::kube::controller::run`, in process) against
//! the API server double and a real 3-member etcd 3.5: the test plays the Machine API
//! (`support::machine_api`: a deleting Machine goes once no pre-drain hook holds it, its etcd
//! killed) and the platform (a learner added for a Machine gets its etcd started there).
//!
//! Scenarios: every member replaced under a live writer; a hook an administrator removed from a
//! deleting Machine stays off; a 409 on every first patch converges; of two replicas only the
//! Lease holder acts, and killing it hands over; the `etcd-warden-operator kube` binary pointed
//! at the double by a kubeconfig (configured through a file, the environment and flags) replaces
//! a member, serves health and metrics, and exits cleanly on SIGTERM; the `EtcdQuorum` status
//! follows a replacement and the cluster going down; a dead Machine deleted by a health check is
//! replaced (its voter removed first); `/healthz`, `/readyz` and `/metrics` over
//! HTTP follow the supervised tasks and the Lease; ownership lost (the owner DNS record, served
//! by a real DNS server on loopback) in the middle of a replacement stops every further action
//! until the record names the operator again.
//!
//! Every member runs on its own loopback address (127.0.0.11, .12, …) on one peer and one client
//! port, as members on separate hosts do, so a Machine's InternalIP is all that names its member.

use crate::support;

use std::collections::{BTreeMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_warden::operator::kube::controller::{self, Settings};
use etcd_warden::operator::quorum::plan::Spec;
use etcd_warden::operator::quorum::resource::{self, EtcdQuorum};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams};
use support::hosts::{Bounds, Load, eventually, ip};
use support::kube_world::{ETCD_NS, KubeWorld, MACHINES_NS};
use support::machine_api::{MachineApi, create_machine, pre_drain};
use tokio_util::sync::CancellationToken;

use support::rbac::OPERATOR;

/// Everything around the controller: [`KubeWorld`] and, when a test asks for it, the Machine
/// API.
struct World {
    kube: KubeWorld,
    machine_api: Option<MachineApi>,
}

impl std::ops::Deref for World {
    type Target = KubeWorld;
    fn deref(&self) -> &KubeWorld {
        &self.kube
    }
}

impl World {
    /// cp-0..cp-2 running etcd and their Machines; the Machine API plays along when `machine_api`.
    async fn start(machine_api: bool) -> World {
        World::start_with(machine_api, false).await
    }

    /// As [`World::start`]; with `tls`, etcd's clients must present a certificate (mutual TLS).
    async fn start_with(machine_api: bool, tls: bool) -> World {
        let kube = KubeWorld::start(tls.then_some(make_certs as fn(&_, &_))).await;
        World {
            machine_api: machine_api.then(|| kube.machine_api()),
            kube,
        }
    }

    fn settings(&self, identity: &str) -> Settings {
        self.kube
            .settings(identity, Spec::new(3).unwrap().replacement)
    }

    /// Starts a controller replica named `identity`.
    fn controller(&self, identity: &str) -> (tokio::task::JoinHandle<()>, CancellationToken) {
        let cancel = CancellationToken::new();
        let task = tokio::spawn(controller::run(
            self.server.client_as(OPERATOR),
            self.settings(identity),
            cancel.clone(),
        ));
        (task, cancel)
    }

    /// Starts replica `op-0` ([`World::controller`]) and waits until it has hooked cp-0..cp-2
    /// and the EtcdQuorum (read through `api`) is all well.
    async fn controller_all_well(
        &self,
        api: &Api<EtcdQuorum>,
    ) -> (tokio::task::JoinHandle<()>, CancellationToken) {
        let ctl = self.controller("op-0");
        self.protected(&["cp-0", "cp-1", "cp-2"]).await;
        conditions_become(api, "all well", Duration::from_secs(20), ALL_WELL).await;
        ctl
    }

    /// Waits until every current Machine carries exactly our hook.
    async fn protected(&self, machines: &[&str]) {
        eventually(
            "hooks on every machine",
            Duration::from_secs(20),
            async || {
                let all = futures::future::join_all(machines.iter().map(|n| self.raw.get(n))).await;
                all.iter()
                    .all(|m| m.as_ref().is_ok_and(|m| pre_drain(m).len() == 1))
                    .then_some(())
            },
        )
        .await;
    }

    /// Creates the next Machine (numbered after every Machine created so far) and deletes `old`;
    /// returns the new Machine's name.
    async fn replace(&self, old: &str) -> String {
        let next = self.names.lock().unwrap().len();
        let (name, addr) = (format!("cp-{next}"), ip(next));
        self.names
            .lock()
            .unwrap()
            .insert(addr.clone(), name.clone());
        create_machine(&self.raw, &name, "master", Some(&addr)).await;
        self.raw
            .delete(old, &DeleteParams::default())
            .await
            .unwrap();
        name
    }

    /// With the platform holding back new members, [`World::replace`]s `old` and waits until
    /// the new Machine's learner is added, not started; returns the new Machine's name.
    async fn replace_held(&self, old: &str, what: &str) -> String {
        self.hosts.hold.store(true, Ordering::SeqCst);
        let new = self.replace(old).await;
        eventually(what, Duration::from_secs(30), async || {
            let m = self.members().await?;
            m.iter().any(|m| m.3 && m.1.is_empty()).then_some(())
        })
        .await;
        new
    }

    /// The operator's Lease names no holder (`why`: it let it go).
    async fn assert_lease_released(&self, why: &str) {
        let leases: Api<Lease> = Api::namespaced(self.kc.clone(), ETCD_NS);
        let lease = leases.get("etcd-warden-operator").await.unwrap();
        assert_eq!(lease.spec.unwrap().holder_identity, None, "{why}");
    }

    /// Waits until the voters are exactly `voters`, with no learner, and `gone` is no Machine.
    async fn settled(&self, voters: &[&str], gone: &str) -> Vec<(u64, String, String, bool)> {
        eventually(
            &format!("voters {voters:?}"),
            Duration::from_secs(60),
            async || {
                let m = self.members().await?;
                let mut v: Vec<String> = m.iter().filter(|m| !m.3).map(|m| m.1.clone()).collect();
                v.sort();
                let is_gone = self.raw.get_opt(gone).await.ok()?.is_none();
                (v == voters && m.len() == voters.len() && is_gone).then_some(m)
            },
        )
        .await
    }

    /// Checks etcd-endpoints lists exactly `members` and the PDB is for `machines`.
    async fn objects_match(&self, members: &[(u64, String, String, bool)], machines: usize) {
        let want: BTreeMap<String, String> = members
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
        let cms: Api<ConfigMap> = Api::namespaced(self.kc.clone(), ETCD_NS);
        let budgets: Api<PodDisruptionBudget> = Api::namespaced(self.kc.clone(), ETCD_NS);
        let want_min = Some(IntOrString::Int(i32::try_from(machines).unwrap() - 1));
        eventually(
            "etcd-endpoints and the PDB",
            Duration::from_secs(10),
            async || {
                let cm = cms.get_opt("etcd-endpoints").await.ok().flatten()?;
                let pdb = budgets.get_opt("etcd-guard-pdb").await.ok().flatten()?;
                let min = pdb.spec.and_then(|s| s.min_available);
                (cm.data.unwrap_or_default() == want && min == want_min).then_some(())
            },
        )
        .await;
    }

    /// (name, reason, reporting instance) of every Event on the Machines.
    async fn events(&self) -> Vec<(String, String, String)> {
        self.machine_events()
            .await
            .into_iter()
            .map(|e| {
                (
                    e.metadata.name.unwrap_or_default(),
                    e.reason.unwrap_or_default(),
                    e.reporting_instance.unwrap_or_default(),
                )
            })
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replacing_every_member_under_writes_loses_nothing() {
    let w = World::start(true).await;
    let (ctl, cancel) = w.controller("op-0");
    w.protected(&["cp-0", "cp-1", "cp-2"]).await;
    w.objects_match(&w.members().await.unwrap(), 3).await;

    let load = Load::start(&w.hosts, &w.names);
    let mut voters = vec!["cp-0".to_string(), "cp-1".into(), "cp-2".into()];
    for old in ["cp-0", "cp-1", "cp-2"] {
        let new = w.replace(old).await;
        voters.retain(|v| v != old);
        voters.push(new);
        voters.sort();
        let want: Vec<&str> = voters.iter().map(String::as_str).collect();
        let members = w.settled(&want, old).await;
        assert!(!w.hosts.is_running(old), "the Machine API terminated {old}");
        w.objects_match(&members, 3).await;
    }
    // Every acknowledged write is there, read linearizably from the final members.
    let urls: Vec<String> = (3..6).map(|n| w.hosts.client_url(&ip(n))).collect();
    let bounds = Bounds {
        min_voters: 3,
        max_voters: Some(4),
        max_learners: Some(1),
    };
    load.finish_within(bounds, &urls).await;

    let reasons: HashSet<String> = w.events().await.into_iter().map(|(_, r, _)| r).collect();
    for r in [
        "DeletionHookAdded",
        "LearnerAdded",
        "LearnerPromoted",
        "MemberRemoved",
        "DeletionHookReleased",
    ] {
        assert!(reasons.contains(r), "no {r} event in {reasons:?}");
    }
    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(10), ctl)
        .await
        .expect("the controller stops")
        .unwrap();
    support::rbac::assert_operator_allowed(&w.server);
    w.assert_lease_released("released on shutdown").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hook_an_administrator_removed_from_a_deleting_machine_is_not_put_back() {
    // No Machine API: the deleted Machine lingers, so a re-added hook would show.
    let w = World::start(false).await;
    let (_ctl, _cancel) = w.controller("op-0");
    w.protected(&["cp-0", "cp-1", "cp-2"]).await;
    w.raw
        .delete("cp-0", &DeleteParams::default())
        .await
        .unwrap();
    let p = serde_json::json!({"spec": {"lifecycleHooks": {"preDrain": []}}});
    w.raw
        .patch(
            "cp-0",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&p),
        )
        .await
        .unwrap();
    // Many resyncs later: still off, and membership untouched (no replacement exists).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let m = w.raw.get("cp-0").await.unwrap();
    assert!(
        pre_drain(&m).is_empty(),
        "hook put back: {:?}",
        pre_drain(&m)
    );
    let members = w.members().await.unwrap();
    assert_eq!(members.iter().filter(|m| !m.3).count(), 3);
    assert!(w.machine_api.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_on_every_first_patch_is_retried_and_converges() {
    let w = World::start(true).await;
    w.server.inject_conflicts(true);
    let (_ctl, _cancel) = w.controller("op-0");
    w.protected(&["cp-0", "cp-1", "cp-2"]).await;
    let new = w.replace("cp-0").await;
    let members = w.settled(&["cp-1", "cp-2", &new], "cp-0").await;
    w.objects_match(&members, 3).await;
    // Every first hook patch met the concurrent writer and was sent again (the new Machine's
    // injected conflict went to the test's own status write when it was created).
    let requests = w.server.requests();
    for m in ["cp-0", "cp-1", "cp-2"] {
        let path = format!(
            "PATCH /apis/machine.openshift.io/v1beta1/namespaces/{MACHINES_NS}/machines/{m}"
        );
        let n = requests
            .iter()
            .filter(|r| r.split('?').next() == Some(path.as_str()))
            .count();
        assert!(n >= 2, "{m}: {n} patches");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_replicas_only_the_lease_holder_acts_and_killing_it_hands_over() {
    let w = World::start(true).await;
    let (first, _c0) = w.controller("op-0");
    w.protected(&["cp-0", "cp-1", "cp-2"]).await;
    let (_second, _c1) = w.controller("op-1");
    let new = w.replace("cp-0").await;
    w.settled(&["cp-1", "cp-2", &new], "cp-0").await;
    let acting: HashSet<String> = w.events().await.into_iter().map(|(_, _, i)| i).collect();
    assert_eq!(
        acting,
        HashSet::from(["op-0".to_string()]),
        "only the holder acts"
    );

    // Killed: its task is dropped mid-flight (its tasks stop with it and let the Lease go; a
    // Lease left to expire is tests/kube_lease.rs's case).
    first.abort();
    let _ = first.await;
    let before: HashSet<String> = w.events().await.into_iter().map(|(n, _, _)| n).collect();
    let newer = w.replace("cp-1").await;
    let members = w.settled(&["cp-2", &new, &newer], "cp-1").await;
    w.objects_match(&members, 3).await;
    let after = w.events().await;
    let acting: HashSet<String> = after
        .into_iter()
        .filter(|(n, _, _)| !before.contains(n))
        .map(|(_, _, i)| i)
        .collect();
    assert_eq!(
        acting,
        HashSet::from(["op-1".to_string()]),
        "the other replica took over"
    );
}

/// Seed 001's controller watchdog: the record moves to another owner in the middle of a
/// replacement (a learner added, not yet started, so the reconcile loop is busy waiting to
/// promote it), and from then on nothing is done: the learner, started and caught up, is not
/// promoted, no member is removed, no hook released, no Event recorded. When the record names the
/// operator again it finishes the replacement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ownership_lost_mid_replacement_stops_every_action_until_it_returns() {
    use etcd_warden::config::OwnerConfig;
    use etcd_warden::owner::guard::GuardSettings;
    const NAME: &str = "owner.operator.warden.test";
    let dns = support::dns::DnsServer::start().await;
    dns.set_txt(NAME, &["seed-a"]).await;
    let w = World::start(true).await;
    let mut settings = w.settings("op-0");
    settings.owner = Some(
        GuardSettings::new(&OwnerConfig {
            name: NAME.into(),
            id: "seed-a".into(),
            interval: Duration::from_millis(50),
            timeout: Duration::from_millis(500),
            nameservers: vec![dns.addr()],
            failure_threshold: 2,
            ttl_cap: Duration::ZERO,
            takeover_after: Duration::from_secs(300),
        })
        .unwrap(),
    );
    let cancel = CancellationToken::new();
    let _ctl = tokio::spawn(controller::run(
        w.server.client_as(OPERATOR),
        settings,
        cancel.clone(),
    ));
    let _stop = cancel.drop_guard();
    w.protected(&["cp-0", "cp-1", "cp-2"]).await;

    let new = w
        .replace_held("cp-0", "a learner for the new machine")
        .await;
    dns.set_txt(NAME, &["seed-b"]).await;
    // The guard looks every 50 ms; one answer naming someone else ends ownership.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let events = w.events().await.len();
    let old_hooks = pre_drain(&w.raw.get("cp-0").await.unwrap());
    assert_eq!(old_hooks.len(), 1);
    w.hosts.hold.store(false, Ordering::SeqCst);
    let started = eventually(
        "the learner's etcd started and caught up",
        Duration::from_secs(30),
        async || {
            let m = w.members().await?;
            m.iter().all(|m| !m.1.is_empty()).then_some(m)
        },
    )
    .await;
    // Long enough for the promotion, the removal and the release to follow several times over.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let mut now = w.members().await.expect("members");
    let mut before = started.clone();
    now.sort();
    before.sort();
    assert_eq!(now, before, "membership changed while not owner");
    assert_eq!(now.iter().filter(|m| m.3).count(), 1, "the learner stays");
    assert_eq!(
        pre_drain(&w.raw.get("cp-0").await.unwrap()),
        old_hooks,
        "the old machine's hook released while not owner"
    );
    assert_eq!(w.events().await.len(), events, "acted while not owner");

    dns.set_txt(NAME, &["seed-a"]).await;
    let members = w.settled(&["cp-1", "cp-2", &new], "cp-0").await;
    w.objects_match(&members, 3).await;
}

/// On Kubernetes the platform starts a new member, so the executor's "start it" is nothing to
/// do; while the platform takes its time, the controller resyncs at its interval instead of
/// stepping again at once after every plan that named an action.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learner_the_platform_has_not_started_is_waited_for_without_spinning() {
    let w = World::start(true).await;
    let (_ctl, _cancel) = w.controller("op-0");
    w.protected(&["cp-0", "cp-1", "cp-2"]).await;
    let new = w.replace_held("cp-0", "a learner, not started").await;
    // One read of etcd-endpoints per reconcile; the resync interval is 200 ms.
    let reconciles = || {
        w.server
            .requests_of(OPERATOR)
            .iter()
            .filter(|r| {
                r.starts_with(&format!(
                    "GET /api/v1/namespaces/{ETCD_NS}/configmaps/etcd-endpoints"
                ))
            })
            .count()
    };
    let before = reconciles();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let n = reconciles() - before;
    assert!(
        n <= 14,
        "{n} reconciles in 2 s at a 200 ms resync: spinning"
    );
    assert!(n >= 5, "{n} reconciles in 2 s: not resyncing");
    w.hosts.hold.store(false, Ordering::SeqCst);
    let members = w.settled(&["cp-1", "cp-2", &new], "cp-0").await;
    w.objects_match(&members, 3).await;
}

/// The operator binary as a child, SIGKILLed when dropped.
struct Binary(Option<Child>);

impl Drop for Binary {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_pointed_at_the_double_by_kubeconfig_replaces_a_member() {
    let w = World::start(true).await;
    let kubeconfig = w.hosts.dir.join("kubeconfig");
    w.server.write_kubeconfig(&kubeconfig, ETCD_NS);
    let log = std::fs::File::create(w.hosts.dir.join("operator.log")).unwrap();
    let http_port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    // Every layer of the configuration: the file, the environment, and flags over both (the
    // file's resync and the environment's identity are overridden).
    let config = w.hosts.dir.join("operator.toml");
    std::fs::write(
        &config,
        format!(
            "namespace = \"{ETCD_NS}\"\nmachine_namespace = \"{MACHINES_NS}\"\n\
             peer_scheme = \"http\"\npeer_port = {}\nresync = \"1h\"\nidentity = \"op-file\"\n",
            w.hosts.peer
        ),
    )
    .unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_etcd-warden-operator"))
        .arg("kube")
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .env("ETCD_WARDEN_OPERATOR_CONFIG", &config)
        .env(
            "ETCD_WARDEN_OPERATOR_ETCD_ENDPOINTS",
            w.client_urls().join(","),
        )
        .env("ETCD_WARDEN_OPERATOR_IDENTITY", "op-env")
        .args(["--identity", "op-bin", "--resync", "200ms"])
        .args(["--listen", &format!("127.0.0.1:{http_port}")])
        .env_remove("ETCD_WARDEN_OPERATOR_KUBECONFIG")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("start etcd-warden-operator kube");
    let mut op = Binary(Some(child));
    w.protected(&["cp-0", "cp-1", "cp-2"]).await;
    let new = w.replace("cp-0").await;
    let members = w.settled(&["cp-1", "cp-2", &new], "cp-0").await;
    w.objects_match(&members, 3).await;
    let acting: HashSet<String> = w.events().await.into_iter().map(|(_, _, i)| i).collect();
    assert_eq!(acting, HashSet::from(["op-bin".to_string()]));
    // The binary serves health and metrics on --listen.
    let base = format!("http://127.0.0.1:{http_port}");
    let (code, body) = http_get(&format!("{base}/healthz")).await.unwrap();
    assert_eq!(code, 200, "{body}");
    let (_, metrics) = http_get(&format!("{base}/metrics")).await.unwrap();
    assert!(
        metrics.contains("etcd_warden_operator_is_leader 1"),
        "{metrics}"
    );

    // SIGTERM: stops acting, releases the Lease, exits 0.
    let mut child = op.0.take().unwrap();
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = eventually(
        "the operator to exit",
        Duration::from_secs(15),
        async || child.try_wait().unwrap(),
    )
    .await;
    let log = std::fs::read_to_string(w.hosts.dir.join("operator.log")).unwrap();
    assert!(status.success(), "exit {status:?}; log:\n{log}");
    w.assert_lease_released("released on SIGTERM").await;
}

/// A CA, a server certificate for `ips`, two client certificates (`client.*`, `client2.*`), and
/// a self-signed client certificate etcd does not trust (`rogue.*`).
fn make_certs(dir: &std::path::Path, ips: &[String]) {
    let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
    support::tls::make_certs_for(dir, &ips, &["client", "client2"]);
    // A self-signed client certificate etcd does not trust.
    support::tls::openssl(
        dir,
        &[
            "req",
            "-x509",
            "-days",
            "1",
            "-subj",
            "/CN=rogue",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "rogue.key",
            "-out",
            "rogue.pem",
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_to_etcd_with_certificates_read_again_without_a_restart() {
    let w = World::start_with(true, true).await;
    let pki = w.hosts.tls.clone().unwrap();
    // The operator's certificate is not there yet: it cannot reach etcd, and keeps trying.
    let own = w.hosts.dir.join("operator-certs");
    std::fs::create_dir_all(&own).unwrap();
    let mut settings = w.settings("op-0");
    settings.etcd_tls = Some(etcd_warden::config::TlsFiles {
        ca_file: Some(pki.join("ca.pem")),
        cert_file: Some(own.join("tls.crt")),
        key_file: Some(own.join("tls.key")),
    });
    let cancel = CancellationToken::new();
    let _ctl = tokio::spawn(controller::run(w.kc.clone(), settings, cancel.clone()));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let m = w.raw.get("cp-0").await.unwrap();
    assert!(pre_drain(&m).is_empty(), "acted without reaching etcd");

    // Mounted (as a Secret volume would be): picked up on the next connection.
    std::fs::copy(pki.join("client.pem"), own.join("tls.crt")).unwrap();
    std::fs::copy(pki.join("client.key"), own.join("tls.key")).unwrap();
    w.protected(&["cp-0", "cp-1", "cp-2"]).await;

    // Rotated: the new member is reached on a new connection, with the new certificate only.
    std::fs::copy(pki.join("client2.pem"), own.join("tls.crt")).unwrap();
    std::fs::copy(pki.join("client2.key"), own.join("tls.key")).unwrap();
    let new = w.replace("cp-0").await;
    let members = w.settled(&["cp-1", "cp-2", &new], "cp-0").await;
    w.objects_match(&members, 3).await;

    // Rotated to a certificate etcd does not trust, while every connection is healthy: the
    // operator drops its connections at once and cannot act; rotated back, it goes on. (etcd
    // refuses a member add for ~5 s after a removal: wait that out first, so that an operator
    // still on its old connections would visibly add a learner.)
    tokio::time::sleep(Duration::from_secs(6)).await;
    std::fs::copy(pki.join("rogue.pem"), own.join("tls.crt")).unwrap();
    std::fs::copy(pki.join("rogue.key"), own.join("tls.key")).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let newer = w.replace("cp-1").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let m = w.members().await.unwrap();
    assert_eq!(
        m.len(),
        3,
        "no learner added with an untrusted certificate: {m:?}"
    );
    std::fs::copy(pki.join("client.pem"), own.join("tls.crt")).unwrap();
    std::fs::copy(pki.join("client.key"), own.join("tls.key")).unwrap();
    let members = w.settled(&["cp-2", &new, &newer], "cp-1").await;
    w.objects_match(&members, 3).await;
    cancel.cancel();
}

/// `type -> (status, reason)` of the EtcdQuorum's conditions, once it has some.
async fn quorum_conditions(api: &Api<EtcdQuorum>) -> Option<BTreeMap<String, (String, String)>> {
    let q = api.get_opt(resource::NAME).await.ok()??;
    let c: BTreeMap<String, (String, String)> = q
        .status?
        .conditions
        .into_iter()
        .map(|c| (c.type_, (c.status, c.reason)))
        .collect();
    (!c.is_empty()).then_some(c)
}

/// Whether every `type=status/reason` in `want` (separated by spaces) is one of `c`.
fn conditions_are(c: &BTreeMap<String, (String, String)>, want: &str) -> bool {
    want.split_whitespace().all(|w| {
        let (t, sr) = w.split_once('=').expect("type=status/reason");
        let (s, r) = sr.split_once('/').expect("type=status/reason");
        c.get(t).is_some_and(|(cs, cr)| cs == s && cr == r)
    })
}

/// Waits until the EtcdQuorum's conditions are `want` (`type=status/reason`, separated by
/// spaces).
async fn conditions_become(api: &Api<EtcdQuorum>, what: &str, timeout: Duration, want: &str) {
    eventually(what, timeout, async || {
        quorum_conditions(api)
            .await
            .filter(|c| conditions_are(c, want))
    })
    .await;
}

const ALL_WELL: &str =
    "Available=True/AsExpected Progressing=False/AsExpected Degraded=False/AsExpected";

/// A member unhealthy, quorum kept: Degraded/UnhealthyMembers only.
const UNHEALTHY: &str =
    "Available=True/AsExpected Progressing=False/AsExpected Degraded=True/UnhealthyMembers";

/// Quorum lost, and the operator not acting.
const NO_QUORUM: &str =
    "Available=False/NoQuorum Progressing=False/NoQuorum Degraded=True/NoQuorum";

/// No member answers: quorum lost and the reconciles failing.
const RECONCILE_FAILED: &str =
    "Available=False/NoQuorum Progressing=False/NoQuorum Degraded=True/ReconcileFailed";

/// No Machine running: the operator does not act.
const MACHINE_API_NOT_FUNCTIONAL: &str = "Available=True/AsExpected \
    Progressing=False/MachineAPINotFunctional Degraded=True/MachineAPINotFunctional";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_etcd_quorum_status_follows_a_replacement_and_a_stopped_member() {
    let w = World::start(true).await;
    let api: Api<EtcdQuorum> = Api::namespaced(w.kc.clone(), ETCD_NS);
    let (_ctl, _cancel) = w.controller_all_well(&api).await;

    // Nothing changes: many resyncs write no status at all.
    let status_path =
        format!("/apis/etcd-warden.io/v1alpha1/namespaces/{ETCD_NS}/etcdquorums/cluster/status");
    let writes = |w: &World| {
        w.server
            .requests()
            .iter()
            .filter(|r| {
                (r.starts_with("PATCH ") || r.starts_with("PUT "))
                    && r.contains("/etcdquorums/cluster")
            })
            .map(|r| r.split('?').next().unwrap_or_default().to_owned())
            .collect::<Vec<_>>()
    };
    let before = writes(&w);
    assert!(!before.is_empty());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(writes(&w).len(), before.len(), "status rewritten unchanged");

    // A replacement: Progressing while it runs, all well again after.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let stop = CancellationToken::new();
    let watcher = {
        let (api, seen, stop) = (api.clone(), Arc::clone(&seen), stop.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                if let Ok(Some(q)) = api.get_opt(resource::NAME).await {
                    let c: BTreeMap<String, (String, String, String)> = q
                        .status
                        .into_iter()
                        .flat_map(|s| s.conditions)
                        .map(|c| (c.type_, (c.status, c.reason, c.message)))
                        .collect();
                    if !c.is_empty() {
                        seen.lock().unwrap().push(c);
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let new = w.replace("cp-0").await;
    w.settled(&["cp-1", "cp-2", &new], "cp-0").await;
    conditions_become(&api, "all well again", Duration::from_secs(20), ALL_WELL).await;
    stop.cancel();
    watcher.await.unwrap();
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.iter().any(
            |c| (c["Progressing"].0.as_str(), c["Progressing"].1.as_str())
                == ("True", "ReplacingMember")
        ),
        "never Progressing/ReplacingMember: {seen:?}"
    );
    // Quorum held throughout, and a replacement going to plan is no degradation. (Only the
    // offending observations are printed: the whole list is too long for a CI log.)
    let offending = |t: &str, want: &str| {
        seen.iter()
            .filter(|c| c[t].0 != want)
            .take(3)
            .cloned()
            .collect::<Vec<_>>()
    };
    assert!(
        offending("Available", "True").is_empty(),
        "{:?}",
        offending("Available", "True")
    );
    assert!(
        offending("Degraded", "False").is_empty(),
        "{:?}",
        offending("Degraded", "False")
    );
    let q = api.get(resource::NAME).await.unwrap();
    let st = q.status.unwrap();
    assert_eq!((st.voters, st.learners, st.desired_voters), (3, 0, 3));
    assert!(st.last_action.is_some());
    // The status went only through /status.
    assert!(
        writes(&w)
            .iter()
            .all(|p| p == &format!("PATCH {status_path}")),
        "{:?}",
        writes(&w)
    );

    // A stopped member: Degraded, UnhealthyMembers, naming it.
    w.hosts.kill("cp-1");
    conditions_become(&api, "UnhealthyMembers", Duration::from_secs(30), UNHEALTHY).await;
    let st = api.get(resource::NAME).await.unwrap().status.unwrap();
    let degraded = st
        .conditions
        .iter()
        .find(|c| c.type_ == "Degraded")
        .unwrap();
    assert!(degraded.message.contains("cp-1"), "{}", degraded.message);
    assert!(
        st.members.iter().any(|m| m.name == "cp-1" && !m.healthy),
        "{:?}",
        st.members
    );

    // A second one: no quorum, and the operator says it does not act.
    w.hosts.kill("cp-2");
    conditions_become(&api, "NoQuorum", Duration::from_secs(30), NO_QUORUM).await;
    // The last one: nothing answers, reconciles fail, and the status says so.
    w.hosts.kill(&new);
    // (after ten retries at the longest backoff, 1 s here)
    conditions_become(
        &api,
        "ReconcileFailed",
        Duration::from_secs(40),
        RECONCILE_FAILED,
    )
    .await;
}

/// Seed 003 on Kubernetes: "The machine health check deletes unhealthy control plane machines
/// so that they are replaced." cp-1's host dies for good (its etcd SIGKILLed) under a writer; a
/// health check deletes its Machine (the test deletes it), and only later is a new Machine
/// created (as the ControlPlaneSet would; the test creates it). The operator removes the dead
/// voter first, so its hook comes off and the Machine API lets the Machine go; the new Machine's
/// member then joins as a learner and is promoted. Three healthy voters again, no acknowledged
/// write lost, voters never below 2, and the `EtcdQuorum` all well. No `etcdctl` anywhere.
///
/// What the double and this test do not check: no MachineHealthCheck controller runs (nothing
/// judges the Machine from its Node's conditions, and no Node goes NotReady: the test deletes
/// the Machine itself); the dead Machine's status stays `Running`, as the double's Machine API
/// never updates phases; no ControlPlaneSet controller creates the new Machine; the platform
/// starts the new member's etcd when it sees the learner (no pod, no kubelet); no admission or
/// RBAC on the requests (the RBAC check of the other scenarios is not repeated here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_machine_deleted_by_a_health_check_is_replaced_without_etcdctl() {
    let w = World::start(true).await;
    let api: Api<EtcdQuorum> = Api::namespaced(w.kc.clone(), ETCD_NS);
    let (_ctl, _cancel) = w.controller_all_well(&api).await;
    let load = Load::start(&w.hosts, &w.names);
    tokio::time::sleep(Duration::from_millis(300)).await;

    w.hosts.kill("cp-1");
    conditions_become(&api, "UnhealthyMembers", Duration::from_secs(30), UNHEALTHY).await;

    // The health check deletes the Machine; no replacement Machine exists yet.
    w.raw
        .delete("cp-1", &DeleteParams::default())
        .await
        .unwrap();
    let left = w.settled(&["cp-0", "cp-2"], "cp-1").await;
    assert_eq!(left.len(), 2, "{left:?}");

    // The new Machine, where the ControlPlaneSet would create it.
    let (name, addr) = ("cp-3".to_string(), ip(3));
    w.names.lock().unwrap().insert(addr.clone(), name.clone());
    create_machine(&w.raw, &name, "master", Some(&addr)).await;
    let members = w.settled(&["cp-0", "cp-2", "cp-3"], "cp-1").await;
    w.protected(&["cp-0", "cp-2", "cp-3"]).await;
    w.objects_match(&members, 3).await;
    conditions_become(&api, "all well again", Duration::from_secs(30), ALL_WELL).await;

    let urls: Vec<String> = [0, 2, 3].map(|n| w.hosts.client_url(&ip(n))).to_vec();
    let bounds = Bounds {
        min_voters: 2,
        max_voters: Some(3),
        max_learners: Some(1),
    };
    load.finish_within(bounds, &urls).await;

    // The removal was the dead voter's, for that reason, on its Machine's Event.
    let removed: Vec<String> = w
        .machine_events()
        .await
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("MemberRemoved"))
        .map(|e| e.note.unwrap_or_default())
        .collect();
    assert_eq!(removed.len(), 1, "{removed:?}");
    assert!(
        removed[0].contains("(cp-1)") && removed[0].contains("UnhealthyOnDeletingMachine"),
        "{removed:?}"
    );
}

async fn http_get(url: &str) -> Option<(u16, String)> {
    let resp = reqwest::get(url).await.ok()?;
    let code = resp.status().as_u16();
    Some((code, resp.text().await.ok()?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_metrics_over_http_follow_the_tasks_and_the_lease() {
    let w = World::start(true).await;
    let serve = |identity: &str| {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let cancel = CancellationToken::new();
        let task = tokio::spawn(controller::run_serving(
            w.kc.clone(),
            w.settings(identity),
            Some(tokio::net::TcpListener::from_std(listener).unwrap()),
            cancel.clone(),
        ));
        (format!("http://{addr}"), task, cancel)
    };
    let (a, a_task, a_cancel) = serve("op-0");
    w.protected(&["cp-0", "cp-1", "cp-2"]).await;
    let (b, _b_task, _b_cancel) = serve("op-1");
    for base in [&a, &b] {
        let (code, body) = eventually("/readyz", Duration::from_secs(10), async || {
            http_get(&format!("{base}/readyz"))
                .await
                .filter(|(c, _)| *c == 200)
        })
        .await;
        assert_eq!((code, body.trim()), (200, "ready"));
        let (code, body) = http_get(&format!("{base}/healthz")).await.unwrap();
        assert_eq!(code, 200, "{body}");
        for task in [
            "lease",
            "events",
            "reconcile",
            "watch-machines",
            "watch-configmap",
            "watch-pdb",
        ] {
            assert!(body.contains(task), "{task} not supervised: {body}");
        }
    }
    let metric = async |base: &str, line: &str| {
        eventually(line, Duration::from_secs(10), async || {
            let (_, m) = http_get(&format!("{base}/metrics")).await?;
            m.lines().any(|l| l == line).then_some(())
        })
        .await
    };
    metric(&a, "etcd_warden_operator_is_leader 1").await;
    metric(&a, "etcd_warden_voters 3").await;
    metric(&b, "etcd_warden_operator_is_leader 0").await;
    // The leader goes: the other takes the Lease and says so.
    a_cancel.cancel();
    a_task.await.unwrap();
    metric(&b, "etcd_warden_operator_is_leader 1").await;
    assert!(
        http_get(&format!("{a}/healthz")).await.is_none(),
        "still serving after shutdown"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_running_machine_the_status_says_the_machine_api_does_not_work() {
    let w = World::start(false).await;
    let phase = |p: &str| serde_json::json!({"status": {"phase": p}});
    for m in ["cp-0", "cp-1", "cp-2"] {
        w.raw
            .patch_status(
                m,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&phase("Provisioning")),
            )
            .await
            .unwrap();
    }
    let api: Api<EtcdQuorum> = Api::namespaced(w.kc.clone(), ETCD_NS);
    let (_ctl, _cancel) = w.controller("op-0");
    conditions_become(
        &api,
        "MachineAPINotFunctional",
        Duration::from_secs(20),
        MACHINE_API_NOT_FUNCTIONAL,
    )
    .await;
    // Not acting meanwhile: no hook on any Machine.
    for m in ["cp-0", "cp-1", "cp-2"] {
        assert!(pre_drain(&w.raw.get(m).await.unwrap()).is_empty(), "{m}");
    }
    // One Machine runs: the operator acts and all is well.
    w.raw
        .patch_status(
            "cp-0",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&phase("Running")),
        )
        .await
        .unwrap();
    w.protected(&["cp-0", "cp-1", "cp-2"]).await;
    conditions_become(&api, "all well", Duration::from_secs(20), ALL_WELL).await;
}

/// `spec.quorumRestore` made while the cluster serves is refused in the status, and nothing
/// changes membership; another survivor is a new request, judged afresh; removing the request
/// removes its status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_restore_requested_while_the_cluster_serves_is_refused() {
    let w = World::start(false).await;
    let api: Api<EtcdQuorum> = Api::namespaced(w.kc.clone(), ETCD_NS);
    let (_ctl, _cancel) = w.controller_all_well(&api).await;
    let request =
        |survivor: serde_json::Value| serde_json::json!({"spec": {"quorumRestore": survivor}});
    let restore_status = async || api.get("cluster").await.ok()?.status?.quorum_restore;
    for survivor in ["cp-0", "freshest"] {
        api.patch(
            "cluster",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&request(serde_json::json!({"survivor": survivor}))),
        )
        .await
        .unwrap();
        let st = eventually(
            "the request refused in the status",
            Duration::from_secs(20),
            async || restore_status().await.filter(|s| s.survivor == survivor),
        )
        .await;
        assert_eq!(st.phase, "Refused", "{st:?}");
        let message = st.message.unwrap_or_default();
        assert!(message.contains("quorum is not lost"), "{message}");
    }
    conditions_become(&api, "all well", Duration::from_secs(20), ALL_WELL).await;
    let members = api.get("cluster").await.unwrap().status.unwrap().members;
    assert_eq!(members.len(), 3, "{members:?}");

    api.patch(
        "cluster",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&request(serde_json::Value::Null)),
    )
    .await
    .unwrap();
    eventually(
        "the request's status removed",
        Duration::from_secs(20),
        async || restore_status().await.is_none().then_some(()),
    )
    .await;
}

/// A quorum restore on Kubernetes, walked through its phases: two of three members lost for
/// good (their etcd SIGKILLed, their disks wiped), `spec.quorumRestore: {survivor: cp-0}` is
/// accepted (`WaitingForRebuild`) and nothing else changes; the administrator's step on the
/// survivor's node (its etcd stopped, `quorum-restore` on its data directory, etcd started
/// again) makes cp-0 serve alone, and the controller says `GrowingBack` and adds a learner on
/// each wiped Machine, one at a time, promoting each; with three healthy voters it says `Done`.
/// Every write acknowledged before the loss is served after.
///
/// What the double and this test do not check: the rebuild runs in the test process through
/// the library (`restore::quorum::quorum_restore`), not in the survivor's pod (no kubelet, no
/// container restart racing the stopped etcd for its data directory); the lost Machines stay
/// (as rebooted hosts with empty disks would) and the platform starts each learner's etcd when
/// it sees it, as in the other scenarios; the double applies no schema, so the CRD's bounds on
/// `survivor` are not exercised here; no RBAC on the administrator's patch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_restore_walks_from_waiting_for_the_rebuild_to_done() {
    use etcd_warden::restore::quorum::{QuorumOptions, Rebuilt, quorum_restore};

    let w = World::start(false).await;
    let api: Api<EtcdQuorum> = Api::namespaced(w.kc.clone(), ETCD_NS);
    let (_ctl, _cancel) = w.controller_all_well(&api).await;
    let mut c = support::hosts::client(&w.client_urls(), None)
        .await
        .unwrap();
    let mut written = BTreeMap::new();
    for i in 0..50 {
        let (k, v) = (format!("w/{i:08}"), format!("v{i}"));
        c.put(k.as_str(), v.as_str(), None).await.unwrap();
        written.insert(k, v);
    }
    drop(c);

    // Two machines lost for good: their etcd gone, their disks wiped.
    for m in ["cp-1", "cp-2"] {
        w.hosts.kill(m);
        let dir = w.hosts.dir.join(m);
        std::fs::rename(&dir, dir.with_extension("lost")).unwrap();
    }
    conditions_become(&api, "NoQuorum", Duration::from_secs(30), NO_QUORUM).await;
    // cp-0, cut off, reports the old leader until its election timeout passes; a request seen
    // before then is refused (fail closed) and judged again at the next reconcile. Waited for,
    // so the phases below are exactly those of an accepted request.
    eventually(
        "cp-0 to know no leader",
        Duration::from_secs(20),
        async || {
            let mut c = support::hosts::client(&[w.hosts.client_url(&ip(0))], None).await?;
            let st = c.status().await.ok()?;
            (st.leader() == 0).then_some(())
        },
    )
    .await;

    // Every phase the status goes through, in order, without repeats.
    let phases = Arc::new(Mutex::new(Vec::<String>::new()));
    let stop = CancellationToken::new();
    let sampler = {
        let (api, phases, stop) = (api.clone(), Arc::clone(&phases), stop.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                let st = api.get_opt(resource::NAME).await.ok().flatten();
                if let Some(r) = st.and_then(|q| q.status?.quorum_restore) {
                    let mut p = phases.lock().unwrap();
                    if p.last() != Some(&r.phase) {
                        p.push(r.phase);
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    api.patch(
        resource::NAME,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(
            &serde_json::json!({"spec": {"quorumRestore": {"survivor": "cp-0"}}}),
        ),
    )
    .await
    .unwrap();
    let phase = async || {
        api.get(resource::NAME)
            .await
            .ok()?
            .status?
            .quorum_restore
            .map(|r| r.phase)
    };
    eventually("WaitingForRebuild", Duration::from_secs(20), async || {
        phase().await.filter(|p| p == "WaitingForRebuild")
    })
    .await;
    // The status says what the administrator runs, and where.
    let waiting = api.get(resource::NAME).await.unwrap().status.unwrap();
    let message = waiting.quorum_restore.unwrap().message.unwrap_or_default();
    assert!(
        message.contains("on Machine cp-0") && message.contains("quorum-restore"),
        "{message}"
    );
    // Waiting changes nothing: still the old three members, the lost ones unstarted.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(phase().await.as_deref(), Some("WaitingForRebuild"));
    assert!(!w.hosts.is_running("cp-1") && !w.hosts.is_running("cp-2"));

    // The administrator's step on cp-0's node: its etcd stopped, the rebuild, etcd started.
    w.hosts.kill("cp-0");
    let opts = QuorumOptions {
        data_dir: w.hosts.dir.join("cp-0"),
        survivors: vec![],
        name: None,
        initial_advertise_peer_urls: None,
        initial_cluster_token: "kube-e2e".into(),
        etcd_bin: Some(support::etcd::Release::V35.bin_dir()),
        lost_for: Duration::from_secs(1),
        probe_interval: Duration::from_millis(200),
        bump: Default::default(),
        force: false,
    };
    let report = quorum_restore(&opts, None).await.unwrap();
    assert_eq!(report.rebuilt, Rebuilt::ForceNewCluster);
    assert_eq!(report.dropped.len(), 2, "{:?}", report.dropped);
    let alone = format!("cp-0={}", w.hosts.peer_url(&ip(0)));
    w.hosts.start("cp-0", &ip(0), &alone, "new");

    let members = w.settled(&["cp-0", "cp-1", "cp-2"], "cp-9").await;
    assert_eq!(members.len(), 3, "{members:?}");
    eventually("Done", Duration::from_secs(30), async || {
        let p = phases.lock().unwrap();
        (p.last().map(String::as_str) == Some("Done")).then_some(())
    })
    .await;
    stop.cancel();
    sampler.await.unwrap();
    assert_eq!(
        *phases.lock().unwrap(),
        ["WaitingForRebuild", "GrowingBack", "Done"],
        "the phases seen"
    );
    conditions_become(&api, "all well again", Duration::from_secs(30), ALL_WELL).await;
    support::hosts::assert_writes_kept(&w.client_urls(), None, &written).await;

    // The request removed: its status goes with it.
    api.patch(
        resource::NAME,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&serde_json::json!({"spec": {"quorumRestore": null}})),
    )
    .await
    .unwrap();
    eventually(
        "the request's status removed",
        Duration::from_secs(20),
        async || phase().await.is_none().then_some(()),
    )
    .await;
}
