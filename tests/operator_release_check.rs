//! The deletion-hook release check against a real 3-member etcd 3.5 with one member cut off
//! from the others (a fault proxy in front of every peer port; see `support::faultproxy`'s
//! `RefuseFrom`).
//!
//! The cut-off follower answers the operator with its own member list, which stops at the
//! partition: a learner added afterwards on a deleting machine's address is missing from it, so
//! the planner, reading that list, sees no member on the machine and plans to release its hook.
//! The executor must not: it releases only after a member list read behind a linearizable read
//! (on the leader) agrees. Without that re-check the hook goes while a member sits on the machine.

use crate::support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, MemberAddOptions};
use etcd_warden::etcd::process::{Bootstrap, ClusterState, EtcdProcess, MemberSpec, PeerUrls};
use etcd_warden::operator::quorum::execute::{BackendError, Machines, Operator, Timing};
use etcd_warden::operator::quorum::plan::{Action, MachineState, Spec};
use support::etcd::Release;
use support::faultproxy::{FaultMode, FaultProxy};
use support::free_port;
use support::hosts::eventually;

/// Machines that do nothing but remember which hooks were released.
struct Recorded {
    machines: Vec<MachineState>,
    released: Mutex<Vec<String>>,
}

#[async_trait::async_trait]
impl Machines for Recorded {
    async fn list(&self) -> Result<Vec<MachineState>, BackendError> {
        Ok(self.machines.clone())
    }
    async fn add_hook(&self, _machine: &str) -> Result<(), BackendError> {
        Ok(())
    }
    async fn release_hook(&self, machine: &str) -> Result<(), BackendError> {
        self.released.lock().unwrap().push(machine.to_owned());
        Ok(())
    }
}

struct Member {
    name: String,
    /// The proxy in front of its peer port: what it advertises.
    proxy: FaultProxy,
    client_url: String,
    _etcd: EtcdProcess,
}

async fn client(url: &str) -> Option<Client> {
    let opts = etcd_client::ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(1))
        .with_timeout(Duration::from_secs(2));
    Client::connect([url], Some(opts)).await.ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_followers_stale_member_list_does_not_release_a_hook() {
    let dir = tempfile::tempdir().unwrap();
    let mut planned = Vec::new();
    for name in ["a", "b", "c"] {
        let listen = free_port();
        let proxy = FaultProxy::start(([127, 0, 0, 1], listen).into()).await;
        planned.push((name.to_owned(), listen, proxy, free_port()));
    }
    let initial: Vec<String> = planned
        .iter()
        .map(|(n, _, p, _)| format!("{n}={}", p.endpoint()))
        .collect();
    let mut members = Vec::new();
    for (name, listen, proxy, client_port) in planned {
        let mut spec = MemberSpec {
            client_port,
            peer_urls: Some(PeerUrls {
                listen: format!("http://127.0.0.1:{listen}"),
                advertise: proxy.endpoint(),
            }),
            bootstrap: Some(Bootstrap {
                initial_cluster: Some(initial.join(",")),
                state: ClusterState::New,
                token: "release-check".into(),
            }),
            no_fsync: true,
            // etcd refuses a member add while the leader has lost touch with any voter; a
            // follower that merely lags (the production case this partition stands for) keeps
            // its connections, so the add would go through. Allowed here for the same effect.
            extra_args: vec!["--strict-reconfig-check=false".into()],
            log: Some(dir.path().join(format!("{name}.log"))),
            ..MemberSpec::new(&name, dir.path().join(&name))
        };
        let etcd = spec.spawn(Release::V35.binaries()).expect("start etcd");
        let client_url = spec.client_url();
        members.push(Member {
            name,
            proxy,
            client_url,
            _etcd: etcd,
        });
    }
    let urls: Vec<String> = members.iter().map(|m| m.client_url.clone()).collect();

    // Formed, and who leads.
    let (ids, leader) = eventually("the cluster to form", Duration::from_secs(30), async || {
        let mut c = client(&urls[0]).await?;
        let list = c.member_list().await.ok()?;
        if list.members().iter().any(|m| m.name().is_empty()) || list.members().len() < 3 {
            return None;
        }
        let leader = c.status().await.ok()?.leader();
        let ids: Vec<(String, u64)> = list
            .members()
            .iter()
            .map(|m| (m.name().to_owned(), m.id()))
            .collect();
        Some((ids, leader))
    })
    .await;
    let id_of = |name: &str| ids.iter().find(|(n, _)| n == name).unwrap().1;
    // Cut off a follower: nothing reaches its peer port, and the others refuse what it sends.
    let stale = members.iter().find(|m| id_of(&m.name) != leader).unwrap();
    let stale_id = id_of(&stale.name);
    stale.proxy.set(FaultMode::Blackhole);
    for m in members.iter().filter(|m| m.name != stale.name) {
        m.proxy.set(FaultMode::RefuseFrom(stale_id));
    }

    // A learner for machine m-new, added through the connected majority; m-new is already
    // being deleted (its replacement was abandoned), its hook still on.
    let new_peer = format!("http://127.0.0.1:{}", free_port());
    let majority = members.iter().find(|m| m.name != stale.name).unwrap();
    eventually(
        "the learner to be added",
        Duration::from_secs(20),
        async || {
            let mut c = client(&majority.client_url).await?;
            let added = c
                .member_add(
                    [new_peer.as_str()],
                    Some(MemberAddOptions::new().with_is_learner()),
                )
                .await;
            if let Err(e) = &added {
                eprintln!("member add: {e}");
            }
            added.ok()
        },
    )
    .await;
    // The premise: the majority lists the learner, the cut-off follower still does not after
    // longer than a connected follower takes to apply it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let lists = |url: String| {
        let new_peer = new_peer.clone();
        async move {
            let mut c = client(&url).await.unwrap();
            let list = c.member_list().await.unwrap();
            list.members()
                .iter()
                .any(|m| m.peer_urls().iter().any(|u| u == &new_peer))
        }
    };
    assert!(lists(majority.client_url.clone()).await);
    assert!(
        !lists(stale.client_url.clone()).await,
        "the cut-off follower already knows the learner: not partitioned"
    );

    let mut machines: Vec<MachineState> = members
        .iter()
        .map(|m| MachineState {
            name: m.name.clone(),
            peer_url: m.proxy.endpoint(),
            deleting: false,
            has_hook: true,
            hook_removed_by_other: false,
        })
        .collect();
    machines.push(MachineState {
        name: "m-new".into(),
        peer_url: new_peer.clone(),
        deleting: true,
        has_hook: true,
        hook_removed_by_other: false,
    });
    let backend = Arc::new(Recorded {
        machines,
        released: Mutex::new(Vec::new()),
    });
    // The operator starts from the cut-off follower: its first observation is that member's list.
    let operator = Operator::new(
        Spec::new(3).unwrap(),
        Arc::clone(&backend),
        vec![stale.client_url.clone()],
        Timing {
            request_timeout: Duration::from_secs(2),
            ..Timing::default()
        },
    );
    let plan = operator.step().await;
    let plan = plan.expect("the step succeeds");
    assert!(
        plan.actions.contains(&Action::ReleaseHook {
            machine: "m-new".into()
        }),
        "the stale list should have made the planner release m-new's hook: {plan:?}"
    );
    assert_eq!(
        *backend.released.lock().unwrap(),
        Vec::<String>::new(),
        "a hook was released while a learner sits on its machine"
    );
}
