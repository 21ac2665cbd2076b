//! Defragmentation against a real 3-member etcd 3.5: the actor next to the leader defragments
//! every member one at a time, moving leadership away before the leader's turn, while a writer
//! keeps writing; the kill switch pauses passes; the fragmentation trigger defragments only the
//! members over its rule; a learner catching up stops a pass.

use crate::support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, CompactionOptions, MemberAddOptions};
use etcd_warden::config::GcPolicy;
use etcd_warden::etcd::RotatingClient;
use etcd_warden::snapshot::actor::{self, ActorConfig, ActorError, ActorHandle, DefragEvent};
use etcd_warden::snapshot::engine::EtcdEngine;
use etcd_warden::snapshot::gate::Gate;
use etcd_warden::snapshot::metrics::SnapshotMetrics;
use etcd_warden::store::Codec;
use etcd_warden::store::gc::Retention;
use prometheus_client::registry::Registry;
use support::etcd::{EtcdCluster, Release};
use tokio_util::sync::CancellationToken;

/// Each member's database size and the part in use by ID, from its own status; and which
/// member leads.
async fn sizes(endpoints: &[String]) -> (HashMap<u64, (i64, i64)>, u64) {
    let mut out = HashMap::new();
    let mut leader = 0;
    for url in endpoints {
        let mut c = Client::connect([url.as_str()], None).await.unwrap();
        let s = c.status().await.unwrap();
        let id = s.header().unwrap().member_id();
        out.insert(id, (s.db_size(), s.raft_used_db_size()));
        leader = s.leader();
    }
    (out, leader)
}

/// ~20 MiB of values, most deleted, history compacted away; returns once every member counts
/// the freed pages as free (bbolt keeps them pending until a later write transaction, so this
/// writes a little while it waits).
async fn fragment(client: &mut Client, endpoints: &[String]) -> HashMap<u64, (i64, i64)> {
    fragment_n(client, endpoints, 200).await
}

/// `n` values of 100 KiB, all but 10 deleted, history compacted away (see [`fragment`]).
async fn fragment_n(
    client: &mut Client,
    endpoints: &[String],
    n: usize,
) -> HashMap<u64, (i64, i64)> {
    let value = "x".repeat(100 * 1024);
    for i in 0..n {
        client
            .put(format!("/bulk/{i:04}"), value.clone(), None)
            .await
            .unwrap();
    }
    for i in 0..n - 10 {
        client.delete(format!("/bulk/{i:04}"), None).await.unwrap();
    }
    let rev = support::etcd::revision(client, &format!("/bulk/{:04}", n - 1)).await;
    client
        .compact(rev, Some(CompactionOptions::new().with_physical()))
        .await
        .unwrap();
    for waited in 0.. {
        let (s, _) = sizes(endpoints).await;
        if s.values().all(|(size, in_use)| *in_use < size / 2) {
            return s;
        }
        assert!(waited < 100, "the compaction never freed the pages: {s:x?}");
        client.put("/tick", "t", None).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    unreachable!()
}

/// Each member's count of its own defragmentations, from its `/metrics`
/// (`etcd_disk_backend_defrag_duration_seconds`): etcd's word, not the sidecar's.
async fn etcd_defrag_counts(endpoints: &[String]) -> HashMap<u64, u64> {
    let mut out = HashMap::new();
    for url in endpoints {
        let mut c = Client::connect([url.as_str()], None).await.unwrap();
        let id = c.status().await.unwrap().header().unwrap().member_id();
        let text = reqwest::get(format!("{url}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let count = text
            .lines()
            .find_map(|l| l.strip_prefix("etcd_disk_backend_defrag_duration_seconds_count "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no defrag count in {url}/metrics"));
        out.insert(id, count);
    }
    out
}

/// A snapshot actor next to the current leader (its etcd endpoint is the leader's alone), the
/// registry its metrics are in, and the leader's ID.
struct Sidecar {
    actor: ActorHandle,
    task: tokio::task::JoinHandle<()>,
    cancel: CancellationToken,
    registry: Registry,
    leader: u64,
    _gate: tokio::sync::watch::Sender<Gate>,
    _dir: tempfile::TempDir,
}

impl Sidecar {
    async fn next_to_leader(
        client: &mut Client,
        endpoints: &[String],
        configure: impl FnOnce(&mut ActorConfig),
    ) -> Sidecar {
        let (_, leader) = sizes(endpoints).await;
        let list = client.member_list().await.unwrap();
        let leader_url = list
            .members()
            .iter()
            .find(|m| m.id() == leader)
            .map(|m| m.client_urls()[0].clone())
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store = support::file_store(dir.path());
        let engine = EtcdEngine::new(
            RotatingClient::connect(&support::etcd::plain_client_config(
                vec![leader_url],
                Duration::from_secs(10),
            ))
            .await
            .unwrap(),
            store.clone(),
            Codec::Gzip,
            Retention {
                policy: GcPolicy::LimitBased { max_backups: 100 },
                delta_retention: Duration::ZERO,
            },
        );
        let metrics = SnapshotMetrics::default();
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let mut config =
            support::quiet_actor_config(Duration::ZERO, u64::MAX, Duration::from_secs(60));
        configure(&mut config);
        let cancel = CancellationToken::new();
        let (gate, gate_rx) = tokio::sync::watch::channel(Gate::Open);
        let (actor, task) = actor::spawn(engine, config, gate_rx, metrics, cancel.clone());
        let mut status = actor.watch_status();
        tokio::time::timeout(Duration::from_secs(10), status.wait_for(|s| s.leader))
            .await
            .expect("the actor sees its member lead")
            .unwrap();
        drop(status);
        Sidecar {
            actor,
            task,
            cancel,
            registry,
            leader,
            _gate: gate,
            _dir: dir,
        }
    }

    fn metrics(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).unwrap();
        text
    }

    fn has(&self, line: &str) -> bool {
        self.metrics().lines().any(|l| l == line)
    }

    async fn stop(self) {
        self.cancel.cancel();
        self.task.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_moves_leadership_before_defragmenting_the_former_leader_while_a_writer_goes_on() {
    let etcd = EtcdCluster::start(3, Release::V35).await;
    let endpoints = etcd.endpoints();
    let mut client = etcd.client().await;
    let before = fragment(&mut client, &endpoints).await;
    assert_eq!(before.len(), 3);
    for (id, (size, _)) in &before {
        assert!(*size > 15 << 20, "member {id:x}: {size} bytes before");
    }

    // A writer over every member, throughout.
    let acked = Arc::new(Mutex::new(Vec::<String>::new()));
    let failed = Arc::new(Mutex::new(Vec::<String>::new()));
    let stop = CancellationToken::new();
    let writer = tokio::spawn({
        let (acked, failed, stop) = (acked.clone(), failed.clone(), stop.clone());
        let mut c = etcd.client().await;
        async move {
            let mut n = 0u64;
            while !stop.is_cancelled() {
                let key = format!("/writer/{n:06}");
                match tokio::time::timeout(Duration::from_secs(5), c.put(key.clone(), "v", None))
                    .await
                {
                    Ok(Ok(_)) => acked.lock().unwrap().push(key),
                    Ok(Err(e)) => failed.lock().unwrap().push(e.to_string()),
                    Err(_) => failed.lock().unwrap().push("timed out".into()),
                }
                n += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    });
    // An observer of who leads, by every member's own status, throughout: per member, the
    // leaders it named in turn.
    let leaders_seen = Arc::new(Mutex::new(HashMap::<String, Vec<u64>>::new()));
    let observer = tokio::spawn({
        let (seen, stop, endpoints) = (leaders_seen.clone(), stop.clone(), endpoints.clone());
        async move {
            while !stop.is_cancelled() {
                for url in &endpoints {
                    let Ok(mut c) = Client::connect([url.as_str()], None).await else {
                        continue;
                    };
                    if let Ok(Ok(s)) =
                        tokio::time::timeout(Duration::from_millis(500), c.status()).await
                    {
                        let mut seen = seen.lock().unwrap();
                        let named = seen.entry(url.clone()).or_default();
                        if named.last() != Some(&s.leader()) && s.leader() != 0 {
                            named.push(s.leader());
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });

    let sidecar = Sidecar::next_to_leader(&mut client, &endpoints, |_| {}).await;
    let former = sidecar.leader;
    let etcd_before = etcd_defrag_counts(&endpoints).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let acked_before = acked.lock().unwrap().len();

    let report = sidecar.actor.defrag().await.expect("defragmentation pass");

    let acked_during = acked.lock().unwrap().len() - acked_before;
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.cancel();
    writer.await.unwrap();
    observer.await.unwrap();

    // Followers one at a time, then a move, then the former leader: never a member while it
    // led (its own status right before its defragmentation named another leader).
    assert_eq!(report.defragmented.len(), 3, "{report:?}");
    assert_eq!(report.defragmented.last(), Some(&former), "{report:?}");
    let moved_to = match report.events[..] {
        [
            DefragEvent::Defragmented { .. },
            DefragEvent::Defragmented { .. },
            DefragEvent::MovedLeader { from, to },
            DefragEvent::Defragmented { member, leader },
        ] => {
            assert_eq!((from, member, leader), (former, former, to), "{report:?}");
            to
        }
        _ => panic!("followers, a move, the former leader: {report:?}"),
    };
    for event in &report.events {
        if let DefragEvent::Defragmented { member, leader } = event {
            assert_ne!(member, leader, "{report:?}");
        }
    }
    // The leader changed, as every member says, and the observer saw it happen once.
    let (after, leader_now) = sizes(&endpoints).await;
    assert_eq!(leader_now, moved_to);
    assert_ne!(leader_now, former);
    let seen = leaders_seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 3, "{seen:x?}");
    for (url, named) in &seen {
        assert_eq!(*named, vec![former, moved_to], "{url}: {seen:x?}");
    }
    // Every member shrank, the former leader too; etcd itself counts one defragmentation each.
    for (id, (size, _)) in &after {
        let was = before[id].0;
        assert!(
            *size < was / 2,
            "member {id:x}: {was} bytes before, {size} after"
        );
    }
    let etcd_after = etcd_defrag_counts(&endpoints).await;
    for (id, n) in &etcd_after {
        assert_eq!(*n, etcd_before[id] + 1, "member {id:x}");
    }

    // The sidecar no longer leads: the new leader's sidecar takes the next full snapshot.
    assert_eq!(report.snapshot, None, "{report:?}");

    // The writer went on: no put failed, and every acknowledged key is there.
    let failed = failed.lock().unwrap().clone();
    assert!(failed.is_empty(), "failed puts: {failed:?}");
    assert!(acked_during > 0, "no put was acknowledged during the pass");
    let acked = acked.lock().unwrap().clone();
    let got = client
        .get(
            "/writer/",
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_keys_only(),
            ),
        )
        .await
        .unwrap();
    let present: std::collections::HashSet<&[u8]> = got.kvs().iter().map(|kv| kv.key()).collect();
    for key in &acked {
        assert!(
            present.contains(key.as_bytes()),
            "{key} acknowledged but lost"
        );
    }

    let text = sidecar.metrics();
    for line in [
        r#"etcdbr_defragmentation_duration_seconds_count{succeeded="true"} 3"#,
        r#"etcd_warden_defrag_passes_total{result="done"} 1"#,
        "etcd_warden_defrag_members_defragmented_total 3",
        "etcd_warden_defrag_leader_moves_total 1",
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in {text}");
    }
    let fractions = text
        .lines()
        .filter(|l| l.starts_with("etcd_warden_defrag_member_free_fraction{member="))
        .count();
    assert_eq!(fractions, 3, "{text}");
    sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leadership_change_in_the_middle_of_a_pass_does_not_drop_it() {
    let etcd = EtcdCluster::start(3, Release::V35).await;
    let endpoints = etcd.endpoints();
    let mut client = etcd.client().await;
    // Larger than the others, so a follower's defragmentation lasts long enough to move
    // leadership under it.
    fragment_n(&mut client, &endpoints, 400).await;
    let sidecar = Sidecar::next_to_leader(&mut client, &endpoints, |_| {}).await;
    let former = sidecar.leader;
    let etcd_before = etcd_defrag_counts(&endpoints).await;
    let list = client.member_list().await.unwrap();
    let url_of = |id: u64| {
        list.members()
            .iter()
            .find(|m| m.id() == id)
            .map(|m| m.client_urls()[0].clone())
            .unwrap()
    };

    // Once the pass has defragmented its first member (the follower with the lower ID, as the
    // plan orders them), leadership moves to that member: an election the pass did not make.
    let first = list
        .members()
        .iter()
        .map(|m| m.id())
        .filter(|id| *id != former)
        .min()
        .unwrap();
    let mut at_leader = Client::connect([url_of(former)], None).await.unwrap();
    let pass = tokio::spawn({
        let actor = sidecar.actor.clone();
        async move {
            let report = actor.defrag().await;
            (report, tokio::time::Instant::now())
        }
    });
    for waited in 0.. {
        if sidecar.has("etcd_warden_defrag_members_defragmented_total 1") {
            break;
        }
        assert!(waited < 60_000, "the pass defragments no first member");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let moving_at = tokio::time::Instant::now();
    at_leader.move_leader(first).await.unwrap();
    let counts = etcd_defrag_counts(&endpoints).await;
    assert_eq!(
        counts[&first],
        etcd_before[&first] + 1,
        "{first:x} came first"
    );

    let (report, ended_at) = pass.await.unwrap();
    let report = report.expect("the pass goes on");
    assert!(moving_at < ended_at, "the election came after the pass");
    // Every member once, none while it led; the former leader as a follower, with no move of
    // the pass's own (the new leader was done already).
    assert_eq!(report.defragmented.len(), 3, "{report:?}");
    for event in &report.events {
        match event {
            DefragEvent::Defragmented { member, leader } => {
                assert_ne!(member, leader, "{report:?}")
            }
            DefragEvent::MovedLeader { .. } => panic!("no move was needed: {report:?}"),
        }
    }
    assert!(report.events.contains(&DefragEvent::Defragmented {
        member: former,
        leader: first
    }));
    let etcd_after = etcd_defrag_counts(&endpoints).await;
    for (id, n) in &etcd_after {
        assert_eq!(*n, etcd_before[id] + 1, "member {id:x}");
    }
    assert!(sidecar.has(r#"etcd_warden_defrag_passes_total{result="done"} 1"#));
    sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kill_switch_pauses_passes_until_it_is_removed() {
    let etcd = EtcdCluster::start(3, Release::V35).await;
    let endpoints = etcd.endpoints();
    let mut client = etcd.client().await;
    let before = fragment(&mut client, &endpoints).await;
    let dir = tempfile::tempdir().unwrap();
    let switch = dir.path().join("no-defrag");
    std::fs::write(&switch, "").unwrap();
    let path = switch.clone();
    let sidecar = Sidecar::next_to_leader(&mut client, &endpoints, move |c| {
        c.defrag.disable_file = Some(path);
    })
    .await;
    let etcd_before = etcd_defrag_counts(&endpoints).await;

    match sidecar.actor.defrag().await {
        Err(ActorError::Unhealthy { reason, done }) => {
            assert!(reason.contains("kill switch"), "{reason}");
            assert!(done.is_empty());
        }
        other => panic!("expected the kill switch to stop the pass, got {other:?}"),
    }
    assert_eq!(etcd_defrag_counts(&endpoints).await, etcd_before);
    let (now, _) = sizes(&endpoints).await;
    for (id, (size, _)) in &now {
        assert!(*size >= before[id].0, "member {id:x} shrank");
    }
    assert!(sidecar.has(r#"etcd_warden_defrag_members_skipped_total{reason="disabled"} 3"#));
    assert!(sidecar.has(r#"etcd_warden_defrag_passes_total{result="stopped"} 1"#));

    // Flipped off without a restart: the next pass runs.
    std::fs::remove_file(&switch).unwrap();
    let report = sidecar.actor.defrag().await.expect("a pass");
    assert_eq!(report.defragmented.len(), 3, "{report:?}");
    sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trigger_defragments_the_member_over_its_rule_and_not_the_others() {
    let etcd = EtcdCluster::start(3, Release::V35).await;
    let endpoints = etcd.endpoints();
    let mut client = etcd.client().await;
    fragment(&mut client, &endpoints).await;
    let (_, leader) = sizes(&endpoints).await;
    // Every member but one follower defragmented by hand: small and with little free.
    let list = client.member_list().await.unwrap();
    let mut followers: Vec<(u64, String)> = list
        .members()
        .iter()
        .filter(|m| m.id() != leader)
        .map(|m| (m.id(), m.client_urls()[0].clone()))
        .collect();
    followers.sort();
    let (fragmented, _) = followers[0].clone();
    for url in endpoints.iter() {
        let mut c = Client::connect([url.as_str()], None).await.unwrap();
        let id = c.status().await.unwrap().header().unwrap().member_id();
        if id != fragmented {
            c.defragment().await.unwrap();
        }
    }
    let (before, _) = sizes(&endpoints).await;
    for (id, (size, in_use)) in &before {
        let over = *size >= 15 << 20 && (*size - *in_use) as f64 / *size as f64 >= 0.45;
        assert_eq!(over, *id == fragmented, "member {id:x}: {size} / {in_use}");
    }
    let etcd_before = etcd_defrag_counts(&endpoints).await;

    let sidecar = Sidecar::next_to_leader(&mut client, &endpoints, |c| {
        c.defrag.check_interval = Some(Duration::from_millis(300));
        c.defrag.trigger_min_db_size = 15 << 20;
        c.defrag.trigger_min_free_fraction = 0.45;
    })
    .await;
    let defragmented = "etcd_warden_defrag_members_defragmented_total 1";
    for waited in 0.. {
        if sidecar.has(defragmented) {
            break;
        }
        assert!(
            waited < 100,
            "the trigger did not act: {}",
            sidecar.metrics()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A few checks more: nothing else is over the rule now.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(sidecar.has(defragmented), "{}", sidecar.metrics());
    assert!(sidecar.has("etcd_warden_defrag_leader_moves_total 0"));
    let etcd_after = etcd_defrag_counts(&endpoints).await;
    for (id, n) in &etcd_after {
        let want = etcd_before[id] + u64::from(*id == fragmented);
        assert_eq!(*n, want, "member {id:x}");
    }
    let (after, _) = sizes(&endpoints).await;
    assert!(after[&fragmented].0 < before[&fragmented].0 / 2);
    // The checks that found nothing count as idle passes, the members under the rule as such.
    let text = sidecar.metrics();
    let count = |prefix: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    assert!(
        count(r#"etcd_warden_defrag_passes_total{result="idle"} "#) >= 1,
        "{text}"
    );
    assert!(
        count(r#"etcd_warden_defrag_members_skipped_total{reason="below_threshold"} "#) >= 2,
        "{text}"
    );
    sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learner_catching_up_stops_the_pass_and_says_so() {
    let etcd = EtcdCluster::start(3, Release::V35).await;
    let endpoints = etcd.endpoints();
    let mut client = etcd.client().await;
    fragment(&mut client, &endpoints).await;
    // A learner that has not caught up: added, not (yet) started.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    // etcd refuses a member change until its members have been connected a few seconds.
    for tries in 0.. {
        let added = client
            .member_add(
                [format!("http://127.0.0.1:{port}")],
                Some(MemberAddOptions::new().with_is_learner()),
            )
            .await;
        match added {
            Ok(_) => break,
            Err(e) if tries < 50 && e.to_string().contains("unhealthy cluster") => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            Err(e) => panic!("adding a learner: {e}"),
        }
    }
    let sidecar = Sidecar::next_to_leader(&mut client, &endpoints, |_| {}).await;
    let etcd_before = etcd_defrag_counts(&endpoints).await;

    match sidecar.actor.defrag().await {
        Err(ActorError::Unhealthy { reason, done }) => {
            assert!(reason.contains("learner"), "{reason}");
            assert!(done.is_empty());
        }
        other => panic!("expected the learner to stop the pass, got {other:?}"),
    }
    assert_eq!(etcd_defrag_counts(&endpoints).await, etcd_before);
    assert!(sidecar.has(r#"etcd_warden_defrag_members_skipped_total{reason="learner"} 3"#));
    let status = sidecar.actor.status();
    assert!(
        status
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("learner")),
        "{status:?}"
    );
    sidecar.stop().await;
}
