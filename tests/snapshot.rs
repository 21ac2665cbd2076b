//! Full and delta snapshots against a real single-member etcd.

use crate::support;

use std::process::Command;
use std::time::Duration;

use etcd_warden::config::GcPolicy;
use etcd_warden::etcd::RotatingClient;
use etcd_warden::snapshot::actor::{self, ActorHandle};
use etcd_warden::snapshot::delta::{self, EventType};
use etcd_warden::snapshot::engine::EtcdEngine;
use etcd_warden::snapshot::gate::Gate;
use etcd_warden::snapshot::metrics::SnapshotMetrics;
use etcd_warden::snapshot::{full, take_full};
use etcd_warden::store::compression::collect;
use etcd_warden::store::gc::Retention;
use etcd_warden::store::{Codec, Kind, SnapshotStore};
use support::etcd::{EtcdCluster, Release};
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_snapshot_is_a_valid_etcd_3_5_snapshot() {
    full_snapshot_is_valid(Release::V35).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_snapshot_is_a_valid_etcd_3_4_snapshot() {
    full_snapshot_is_valid(Release::V34).await;
}

/// Needs `$ETCD36_BIN_DIR` (skipped without it, as in CI).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_snapshot_is_a_valid_etcd_3_6_snapshot() {
    if let Some(release) = Release::v36("full_snapshot_is_a_valid_etcd_3_6_snapshot") {
        full_snapshot_is_valid(release).await;
    }
}

/// A full snapshot that must hold exactly `revision`.
async fn exactly(
    client: &etcd_client::Client,
    store: &SnapshotStore,
    revision: i64,
) -> Result<etcd_warden::store::Snapshot, full::FullError> {
    let target = full::Target::Exactly {
        codec: Codec::Gzip,
        revision,
    };
    full::take_full_as(client, store, target)
        .await
        .map(|(s, _)| s)
}

/// Puts `keys` keys `/registry/kNNNNN` of `value_len` bytes each; etcd's revision after them.
async fn fill(client: &mut etcd_client::Client, keys: usize, value_len: usize) -> i64 {
    let value = "v".repeat(value_len);
    for i in 0..keys {
        client
            .put(format!("/registry/k{i:05}"), value.clone(), None)
            .await
            .unwrap();
    }
    support::etcd::revision(client, "warmup").await
}

async fn full_snapshot_is_valid(release: Release) {
    let etcd = EtcdCluster::single(release).await;
    let mut client = etcd.client().await;
    let revision = fill(&mut client, 1500, 2000).await;
    let dir = tempfile::tempdir().unwrap();
    let store = support::file_store(&dir.path().join("store"));

    let snap = support::stored::gzip_full(&client, &store).await;
    assert_eq!(snap.kind, Kind::Full);
    assert_eq!(snap.last_revision, revision);
    assert!(snap.snap_name.ends_with(".gz"), "{}", snap.snap_name);
    let fin = take_full(&client, &store, Codec::Zlib, true).await.unwrap();
    assert!(fin.snap_name.ends_with(".zlib.final"), "{}", fin.snap_name);
    assert_eq!(store.list().await.unwrap().len(), 2);

    // The stored payload is etcd's snapshot as is: etcdutl checks its hash and restores it.
    for s in [&snap, &fin] {
        let db = collect(store.get_decoded(s).await.unwrap()).await.unwrap();
        assert!(db.len() > 1500 * 2000, "{} bytes", db.len());
        let stored = std::fs::metadata(dir.path().join("store").join(s.key()))
            .unwrap()
            .len();
        assert!(
            stored < db.len() as u64 / 4,
            "{stored} stored for {}",
            db.len()
        );
        let file = dir.path().join(format!("{}.db", s.snap_name));
        std::fs::write(&file, &db).unwrap();
        // etcd 3.4 has no etcdutl; its etcdctl restores (and checks the hash) the same way.
        let tool = match release {
            Release::V35 | Release::V36 => release.bin("etcdutl"),
            Release::V34 => release.bin("etcdctl"),
        };
        support::cli::succeeds(
            Command::new(tool)
                .env("ETCDCTL_API", "3")
                .args(["snapshot", "restore"])
                .arg(&file)
                .arg("--data-dir")
                .arg(dir.path().join(format!("restored-{}", s.snap_name))),
        );
    }

    // A corrupted stream (one flipped byte) is refused and never stored.
    let mut db = collect(store.get_decoded(&snap).await.unwrap())
        .await
        .unwrap();
    let mid = db.len() / 2;
    db[mid] ^= 0x40;
    let bad = store.new_snapshot(Kind::Full, 0, revision + 1, Codec::Gzip, false);
    let e = full::store_payload(
        &store,
        &bad,
        etcd_warden::store::compression::once(db),
        Codec::Gzip,
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("SHA-256"), "{e}");
    assert_eq!(store.list().await.unwrap().len(), 2);
}

/// The snapshot actor over the real engine, regular and (single member) leader from the start.
/// The full-snapshot schedule is far away: only the store's state and deltas drive it.
async fn actor_on(
    etcd: &EtcdCluster,
    store: &SnapshotStore,
    codec: Codec,
    delta_period: Duration,
    delta_memory_limit: u64,
) -> (ActorHandle, tokio::task::JoinHandle<()>, CancellationToken) {
    actor_with(etcd, store, codec, delta_period, delta_memory_limit)
        .spawn(SnapshotMetrics::default())
        .await
}

/// How [`actor_on`] builds the actor, for tests that set the timeout and read the metrics.
struct ActorSetup<'a> {
    etcd: &'a EtcdCluster,
    store: SnapshotStore,
    codec: Codec,
    delta_period: Duration,
    delta_memory_limit: u64,
    timeout: Duration,
    request_timeout: Duration,
}

fn actor_with<'a>(
    etcd: &'a EtcdCluster,
    store: &SnapshotStore,
    codec: Codec,
    delta_period: Duration,
    delta_memory_limit: u64,
) -> ActorSetup<'a> {
    ActorSetup {
        etcd,
        store: store.clone(),
        codec,
        delta_period,
        delta_memory_limit,
        timeout: Duration::from_secs(60),
        request_timeout: Duration::from_secs(5),
    }
}

impl ActorSetup<'_> {
    fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn request_timeout(mut self, request_timeout: Duration) -> Self {
        self.request_timeout = request_timeout;
        self
    }

    async fn spawn(
        self,
        metrics: SnapshotMetrics,
    ) -> (ActorHandle, tokio::task::JoinHandle<()>, CancellationToken) {
        let ActorSetup {
            etcd,
            store,
            codec,
            delta_period,
            delta_memory_limit,
            timeout,
            request_timeout,
        } = self;
        let endpoints = etcd.endpoints();
        let cancel = CancellationToken::new();
        let config = support::quiet_actor_config(delta_period, delta_memory_limit, timeout);
        let c = cancel.clone();
        let engine = {
            let etcd = RotatingClient::connect(&support::etcd::plain_client_config(
                endpoints,
                request_timeout,
            ))
            .await
            .unwrap();
            let retention = Retention {
                policy: GcPolicy::LimitBased { max_backups: 100 },
                delta_retention: Duration::ZERO,
            };
            EtcdEngine::new(etcd, store, codec, retention)
        };
        // No ownership checks: the gate is open for good (nobody keeps the sender).
        let (_, gate_rx) = tokio::sync::watch::channel(Gate::Open);
        let (handle, task) = actor::spawn(engine, config, gate_rx, metrics, c);
        (handle, task, cancel)
    }
}

/// Waits until the actor has stored a delta reaching `revision`.
async fn wait_for_delta(actor: &ActorHandle, revision: i64) {
    let mut status = actor.watch_status();
    let reached = support::seen_within(&mut status, Duration::from_secs(10), |s| {
        s.last_delta
            .as_ref()
            .is_some_and(|d| d.last_revision >= revision)
    })
    .await;
    assert!(
        reached,
        "no delta reached revision {revision}: {:?}",
        actor.status()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deltas_follow_the_watch_from_the_full_snapshot() {
    let (etcd, mut client, _dir, store) = support::etcd_and_file_store().await;
    client.put("before", "x", None).await.unwrap();
    let base = support::stored::gzip_full(&client, &store).await;

    // Changes made while no actor runs are still picked up: the watch starts at base + 1.
    client.put("a", "1", None).await.unwrap();
    let (actor, task, cancel) = actor_on(
        &etcd,
        &store,
        Codec::Gzip,
        Duration::from_millis(300),
        u64::MAX,
    )
    .await;
    client.put("b", "2", None).await.unwrap();
    let b = base.last_revision + 2;
    wait_for_delta(&actor, b).await;
    client.delete("a", None).await.unwrap();
    client
        .txn(etcd_client::Txn::new().and_then([
            etcd_client::TxnOp::put("c", "3", None),
            etcd_client::TxnOp::put("d", "4", None),
        ]))
        .await
        .unwrap();
    let last = support::etcd::revision(&mut client, "c").await;
    wait_for_delta(&actor, last).await;
    cancel.cancel();
    task.await.unwrap();

    let list = store.list().await.unwrap();
    let chain = etcd_warden::store::layout::latest_chain(&list);
    // No second full snapshot: the stored one was recent enough for the schedule.
    assert_eq!(chain.full_snapshot.as_ref(), Some(&base));
    assert!(
        chain.delta_snapshots.len() >= 2,
        "periodic flushes: {:?}",
        chain.delta_snapshots
    );
    // Contiguous: each delta starts right after the previous snapshot.
    let mut prev = base.last_revision;
    let mut events = Vec::new();
    for d in &chain.delta_snapshots {
        assert_eq!(d.start_revision, prev + 1, "{}", d.snap_name);
        prev = d.last_revision;
        events.extend(delta::read(&store, d).await.unwrap());
    }
    assert_eq!(prev, last);
    let seen: Vec<(EventType, String, i64)> = events
        .iter()
        .map(|e| {
            let kv = e.event.kv.as_ref().unwrap();
            (
                e.event.kind,
                String::from_utf8(kv.key.clone()).unwrap(),
                kv.mod_revision,
            )
        })
        .collect();
    let r = base.last_revision;
    assert_eq!(
        seen,
        vec![
            (EventType::Put, "a".into(), r + 1),
            (EventType::Put, "b".into(), r + 2),
            (EventType::Delete, "a".into(), r + 3),
            (EventType::Put, "c".into(), r + 4),
            (EventType::Put, "d".into(), r + 4),
        ]
    );
    assert_eq!(events[3].event.kv.as_ref().unwrap().value, b"3");
}

/// A delta watch catching up over many large values (a sidecar back from a store outage, which
/// stops reading the watch at `snapshot.delta_memory_limit`) reads etcd's batch of up to 1,000
/// revisions in fragments of at most `--max-request-bytes`, not as one message: before, 14 MiB of
/// values came as one batch, and 1,000 values of 1.5 MiB would have been one of 1.5 GiB. A
/// transaction etcd splits across two fragments still comes in one batch (a delta ending inside
/// it would lose its rest: the writer skips revisions it already holds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catch_up_watch_comes_in_fragments_and_keeps_each_revision_whole_on_3_5() {
    catch_up_in_fragments(Release::V35).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catch_up_watch_comes_in_fragments_and_keeps_each_revision_whole_on_3_4() {
    catch_up_in_fragments(Release::V34).await;
}

async fn catch_up_in_fragments(release: Release) {
    use etcd_client::{Txn, TxnOp};
    let etcd = EtcdCluster::single(release).await;
    let mut client = etcd.client().await;
    let from = support::etcd::revision(&mut client, "start").await + 1;
    // etcd's default `--max-request-bytes` is 1.5 MiB: a fragment closes before passing it. The
    // first fragment takes `one` and the transaction's first put, the second its other two.
    client
        .put("one", vec![b'1'; 1_000_000], None)
        .await
        .unwrap();
    let txn = Txn::new()
        .and_then(["t/a", "t/b", "t/c"].map(|k| TxnOp::put(k, vec![b't'; 500_000], None)));
    client.txn(txn).await.unwrap();
    for i in 0..12 {
        client
            .put(format!("big/{i:02}"), vec![b'b'; 1_200_000], None)
            .await
            .unwrap();
    }
    let head = support::etcd::revision(&mut client, "big/11").await;
    let mut watch = etcd_warden::snapshot::watcher::DeltaWatch::open(&client, from)
        .await
        .unwrap();
    let mut batches: Vec<Vec<delta::Event>> = Vec::new();
    while batches
        .last()
        .and_then(|b| b.last())
        .map_or(0, delta::Event::revision)
        < head
    {
        let batch = tokio::time::timeout(Duration::from_secs(30), watch.next())
            .await
            .expect("the watch catches up")
            .unwrap();
        if !batch.is_empty() {
            batches.push(batch);
        }
    }
    let sizes: Vec<usize> = batches
        .iter()
        .map(|b| b.iter().map(delta::Event::size).sum())
        .collect();
    // A fragment under 1.5 MiB, and the revision it left open, itself under 1.5 MiB.
    assert!(
        sizes.iter().all(|&s| s <= 3 << 20),
        "a batch beyond a fragment and the revision it left open: {sizes:?}"
    );
    let revisions: Vec<Vec<i64>> = batches
        .iter()
        .map(|b| b.iter().map(delta::Event::revision).collect())
        .collect();
    for pair in revisions.windows(2) {
        assert!(
            pair[0].last() < pair[1].first(),
            "a revision spans two batches: {revisions:?}"
        );
    }
    let keys: Vec<String> = batches
        .iter()
        .flatten()
        .map(|e| String::from_utf8(e.kv.as_ref().unwrap().key.clone()).unwrap())
        .collect();
    let expected: Vec<String> = ["one", "t/a", "t/b", "t/c"]
        .map(String::from)
        .into_iter()
        .chain((0..12).map(|i| format!("big/{i:02}")))
        .collect();
    assert_eq!(keys, expected);
    drop(etcd);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_limit_flushes_early() {
    let (etcd, mut client, _dir, store) = support::etcd_and_file_store().await;
    let base = take_full(&client, &store, Codec::None, false)
        .await
        .unwrap();
    // The period is an hour: only the limit can flush each write on its own.
    let metrics = SnapshotMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let (actor, task, cancel) =
        actor_with(&etcd, &store, Codec::None, Duration::from_secs(3600), 1)
            .spawn(metrics)
            .await;
    for i in 0..3 {
        let r = client
            .put(format!("k{i}"), "v", None)
            .await
            .unwrap()
            .header()
            .unwrap()
            .revision();
        wait_for_delta(&actor, r).await;
    }
    cancel.cancel();
    task.await.unwrap();
    let deltas = store.latest_chain().await.unwrap().delta_snapshots;
    assert_eq!(deltas.len(), 3, "{deltas:?}");
    assert_eq!(deltas[0].start_revision, base.last_revision + 1);
    assert!(deltas.iter().all(|d| d.start_revision == d.last_revision));
    // The reference's chain gauges: three deltas since the full snapshot, spanning from the
    // first one's start to the last one's revision; nothing left to write.
    assert_eq!(
        metric_value(&registry, "etcdbr_snapstore_latest_deltas_total"),
        3.0
    );
    assert_eq!(
        metric_value(&registry, "etcdbr_snapstore_latest_deltas_revisions_total"),
        (deltas[2].last_revision - deltas[0].start_revision) as f64
    );
    assert_eq!(
        metric_value(&registry, r#"etcdbr_snapshot_required{kind="Incr"}"#),
        0.0
    );
}

/// The two-hour soak's memory spike at its smallest: the store refuses deltas while etcd takes
/// writes. The buffer stops at `snapshot.delta_memory_limit` plus at most the one watch response
/// that crossed it (etcd sends at most 1,000 revisions in one) instead of growing with every
/// write, and once the store takes deltas again the chain goes on with every revision, none lost
/// and none twice. Before, the buffer held every write made while the store was down (here 80
/// times the limit, about 4 times the bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_refusing_deltas_holds_the_buffer_at_the_memory_limit_and_loses_nothing() {
    use support::losing::{LosingStore, Loss};
    const LIMIT: u64 = 16 * 1024;
    const VALUE: usize = 256;
    const PUTS: usize = 4096;
    // What one event of these puts counts for (`Event::size`: key, value and 48 bytes).
    const EVENT: u64 = VALUE as u64 + 64;

    let etcd = EtcdCluster::single(Release::V35).await;
    let mut client = etcd.client().await;
    let memory: std::sync::Arc<dyn object_store::ObjectStore> =
        std::sync::Arc::new(object_store::memory::InMemory::new());
    let refusing = std::sync::Arc::new(LosingStore::new(memory, ".gz", Loss::Refused, 0));
    let store = SnapshotStore::new(refusing.clone(), "p");
    let base = take_full(&client, &store, Codec::Gzip, false)
        .await
        .unwrap();
    refusing.lose_next(u32::MAX);
    let metrics = SnapshotMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let (actor, task, cancel) =
        actor_with(&etcd, &store, Codec::Gzip, Duration::from_secs(1), LIMIT)
            .spawn(metrics)
            .await;
    let buffered = || metric_value(&registry, "etcd_warden_delta_buffered_bytes") as u64;
    let (mut peak, mut last) = (0, 0);
    for i in 0..PUTS {
        last = client
            .put(format!("k{i}"), vec![b'v'; VALUE], None)
            .await
            .unwrap()
            .header()
            .unwrap()
            .revision();
        peak = peak.max(buffered());
    }
    // Three delta periods with the store still down: three more failed flushes.
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        peak = peak.max(buffered());
    }
    assert!(
        (LIMIT..=LIMIT + 1000 * EVENT).contains(&peak),
        "buffered at most {peak} bytes with a limit of {LIMIT}"
    );
    assert!(actor.status().last_delta.is_none(), "{:?}", actor.status());

    refusing.lose_next(0);
    wait_for_delta(&actor, last).await;
    cancel.cancel();
    task.await.unwrap();
    let chain = store.latest_chain().await.unwrap();
    assert_eq!(
        chain.full_snapshot.unwrap().last_revision,
        base.last_revision
    );
    let mut seen = Vec::new();
    for d in &chain.delta_snapshots {
        seen.extend(
            delta::read(&store, d)
                .await
                .unwrap()
                .iter()
                .map(|e| e.event.revision()),
        );
    }
    assert_eq!(seen, ((base.last_revision + 1)..=last).collect::<Vec<_>>());
}

/// Resumes a process stopped with SIGSTOP when dropped, so a failing test leaves no frozen etcd.
struct Frozen(nix::unistd::Pid);

impl Frozen {
    fn freeze(pid: u32) -> Frozen {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap());
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
        Frozen(pid)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(self.0, nix::sys::signal::Signal::SIGCONT);
    }
}

fn metric_value(registry: &prometheus_client::registry::Registry, series: &str) -> f64 {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
}

/// etcd frozen (SIGSTOP: its socket still accepts, nothing answers) with `snapshot.timeout`
/// shorter than `etcd.request_timeout`: each full snapshot fails after the snapshot timeout with
/// an error naming it, counts as a failure, and the actor answers the next request; once etcd
/// runs again the next snapshot is stored. Also the member's place in the cluster, from etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_etcd_times_out_snapshots_and_the_actor_goes_on() {
    let (etcd, mut client, _dir, store) = support::etcd_and_file_store().await;
    client.put("k", "v", None).await.unwrap();
    let metrics = SnapshotMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let (actor, task, cancel) = actor_with(&etcd, &store, Codec::Gzip, Duration::ZERO, u64::MAX)
        .timeout(Duration::from_secs(1))
        .request_timeout(Duration::from_secs(4))
        .spawn(metrics)
        .await;
    // The empty store makes a full snapshot due at once.
    let mut status = actor.watch_status();
    let first = support::seen_within(&mut status, Duration::from_secs(20), |s| {
        s.last_full.is_some()
    })
    .await;
    assert!(first, "no first full snapshot: {:?}", actor.status());
    assert_eq!(metric_value(&registry, "etcdbr_cluster_size"), 1.0);
    assert_eq!(metric_value(&registry, "etcdbr_is_learner"), 0.0);
    assert!(
        metric_value(
            &registry,
            r#"etcd_warden_snapshot_latest_size_bytes{kind="Full"}"#
        ) > 0.0
    );

    let frozen = Frozen::freeze(etcd.members[0].pid().expect("etcd runs"));
    for attempt in 1..=2 {
        let started = std::time::Instant::now();
        let e = actor.full().await.unwrap_err().to_string();
        assert!(
            e.contains("full snapshot took longer than snapshot.timeout (1s)"),
            "attempt {attempt}: {e}"
        );
        // The snapshot timeout fired, not etcd's request timeout (4 s) nor the leader check's.
        assert!(
            started.elapsed() < Duration::from_secs(9),
            "attempt {attempt} took {:?}",
            started.elapsed()
        );
    }
    assert_eq!(
        metric_value(&registry, r#"etcdbr_snapshotter_failure{error="timeout"}"#),
        2.0
    );
    assert_eq!(
        metric_value(
            &registry,
            r#"etcdbr_snapshot_duration_seconds_count{kind="Full",succeeded="false"}"#
        ),
        2.0
    );
    assert!(
        actor
            .status()
            .last_error
            .is_some_and(|e| e.contains("snapshot.timeout"))
    );

    drop(frozen);
    let stored = tokio::time::timeout(Duration::from_secs(30), actor.full())
        .await
        .expect("the actor answers")
        .expect("etcd runs again: the snapshot is stored");
    assert!(store.list().await.unwrap().contains(&stored));
    assert_eq!(
        metric_value(
            &registry,
            r#"etcdbr_snapshot_duration_seconds_count{kind="Full",succeeded="true"}"#
        ),
        2.0
    );
    cancel.cancel();
    task.await.unwrap();
}

/// A requested full snapshot (`POST /snapshot/full`) is marked as requested by the time the
/// actor answers, and a scheduled one is not. The marker used to be written by the HTTP handler
/// after the answer: a retention pass of the actor in between counted the requested snapshot
/// among the scheduled ones and, with `LimitBased`, could expire the oldest scheduled one (the
/// robustness harness's finding, seen as a flaky object-lock test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requested_full_snapshot_is_marked_before_the_actor_answers() {
    let (etcd, mut client, _dir, store) = support::etcd_and_file_store().await;
    client.put("k", "v", None).await.unwrap();
    let (actor, task, cancel) =
        actor_on(&etcd, &store, Codec::Gzip, Duration::ZERO, u64::MAX).await;
    // The empty store makes a scheduled full snapshot due at once.
    let mut status = actor.watch_status();
    assert!(
        support::seen_within(&mut status, Duration::from_secs(20), |s| s
            .last_full
            .is_some())
        .await,
        "no scheduled full snapshot: {:?}",
        actor.status()
    );
    let scheduled = actor.status().last_full.expect("a scheduled full snapshot");
    client.put("k", "w", None).await.unwrap();

    let requested = actor.full().await.expect("a requested full snapshot");

    let marked = etcd_warden::store::gc::triggered_names(&store)
        .await
        .unwrap();
    assert!(marked.contains(&requested.snap_name), "{marked:?}");
    assert!(!marked.contains(&scheduled.snap_name), "{marked:?}");
    cancel.cancel();
    task.await.unwrap();
}

/// Flushes deltas until one reaching `revision` is stored (the schedule flushes none).
async fn flush_through(actor: &ActorHandle, revision: i64) {
    for _ in 0..200 {
        actor.delta().await.expect("a requested delta");
        if actor
            .status()
            .last_delta
            .is_some_and(|d| d.last_revision >= revision)
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no delta reached revision {revision}: {:?}", actor.status());
}

/// Issue 54, item 12: a requested full snapshot restarted the delta writer, dropping the
/// buffered events it covered, so the scheduled chain it fell in had a gap there once
/// retention deleted the request (and retention had to keep every request to keep the chain
/// whole). The deltas now go on through it: the chain from the scheduled full snapshot is
/// whole without the request, and the chain from the request is whole too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deltas_go_on_through_a_requested_full_snapshot() {
    let (etcd, mut client, _dir, store) = support::etcd_and_file_store().await;
    client.put("before", "x", None).await.unwrap();
    let base = support::stored::gzip_full(&client, &store).await;
    let (actor, task, cancel) = actor_on(
        &etcd,
        &store,
        Codec::Gzip,
        Duration::from_secs(3600),
        u64::MAX,
    )
    .await;
    client.put("a", "1", None).await.unwrap();
    let a = support::etcd::revision(&mut client, "a").await;
    flush_through(&actor, a).await;
    // Waits in the writer's buffer (or is still on its way to it) when the request comes.
    client.put("b", "2", None).await.unwrap();
    let b = support::etcd::revision(&mut client, "b").await;
    let requested = actor.full().await.expect("a requested full snapshot");
    assert!(requested.last_revision >= b, "{requested:?}");
    client.put("c", "3", None).await.unwrap();
    let c = support::etcd::revision(&mut client, "c").await;
    flush_through(&actor, c).await;
    cancel.cancel();
    task.await.unwrap();

    let mut list = store.list().await.unwrap();
    etcd_warden::store::layout::sort(&mut list);
    for from in [&base, &requested] {
        let at = list.iter().position(|s| s == from);
        assert!(at.is_some(), "{} is listed", from.snap_name);
        let chain = etcd_warden::store::layout::chain_from(&list, at);
        assert_eq!(
            etcd_warden::store::layout::first_gap(&chain),
            None,
            "from {}: {:?}",
            from.snap_name,
            chain.delta_snapshots
        );
        assert_eq!(
            chain.delta_snapshots.last().map(|d| d.last_revision),
            Some(c),
            "from {}",
            from.snap_name
        );
    }
}

/// A snapshot that must hold exactly one revision is refused, with nothing stored, when a write
/// lands while etcd streams it: the revision is read again after the last byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exact_revision_snapshot_moved_by_a_write_during_its_stream_stores_nothing() {
    let etcd = EtcdCluster::single(Release::V35).await;
    let mut client = etcd.client().await;
    // Big enough (~40 MB) that streaming and compressing it takes far longer than one put.
    let revision = fill(&mut client, 2000, 20_000).await;
    let dir = tempfile::tempdir().unwrap();
    let store = support::file_store(&dir.path().join("store"));

    // Unmoved, it is stored at that revision.
    let quiet = exactly(&client, &store, revision).await.unwrap();
    assert_eq!(quiet.last_revision, revision);
    store.delete(&quiet).await.unwrap();

    let mut writer = client.clone();
    let (taken, _) = tokio::join!(exactly(&client, &store, revision), async move {
        tokio::time::sleep(Duration::from_millis(30)).await;
        writer.put("/registry/late", "x", None).await.unwrap();
    });
    match taken {
        Err(full::FullError::Moved { expected, found }) => {
            assert_eq!((expected, found), (revision, revision + 1));
        }
        other => panic!("expected Moved, got {other:?}"),
    }
    assert!(store.list().await.unwrap().is_empty(), "nothing stored");

    // Asked for a revision it has already passed, it refuses before streaming.
    let e = exactly(&client, &store, revision).await.unwrap_err();
    assert!(
        matches!(e, full::FullError::Moved { found, .. } if found == revision + 1),
        "{e}"
    );
}

/// etcd restored to an older state than the store's newest snapshot: the store's snapshots
/// after etcd's revision are another history. `resume` sets them aside (kept, out of the
/// layout) and asks for a new base; the next restore gives exactly what the restored etcd then
/// holds, new writes included, and nothing of the abandoned history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_restored_behind_the_store_sets_the_newer_history_aside_and_starts_a_new_base() {
    use etcd_warden::snapshot::actor::Engine;
    let (_etcd, mut client, dir, store) = support::etcd_and_file_store().await;
    for i in 0..20 {
        client.put(format!("/k/{i:03}"), "v0", None).await.unwrap();
    }
    let full = support::stored::gzip_full(&client, &store).await;
    // An etcd restored from the full snapshot alone: older than what the store will hold.
    let old = dir.path().join("old");
    let opts = support::history::restore_options(&old);
    etcd_warden::restore::restore(&store, &opts).await.unwrap();
    // The original etcd goes on, and its deltas reach the store.
    let mut writer = delta::DeltaWriter::new(Codec::Gzip, full.last_revision);
    let mut watch =
        etcd_warden::snapshot::watcher::DeltaWatch::open(&client, full.last_revision + 1)
            .await
            .unwrap();
    for i in 0..30 {
        client
            .put(format!("/k/{i:03}"), "abandoned", None)
            .await
            .unwrap();
    }
    let head = support::etcd::revision(&mut client, "x").await;
    let mut events = Vec::new();
    while events.last().map_or(0, delta::Event::revision) < head {
        events.extend(watch.next().await.unwrap());
    }
    writer.push(events, chrono::Utc::now());
    writer.flush(&store).await.unwrap().unwrap();
    assert_eq!(store.list().await.unwrap().len(), 2);

    let tools = etcd_warden::restore::EtcdTools::locate(Some(&Release::V35.bin_dir()))
        .await
        .unwrap();
    let restored =
        etcd_warden::restore::TempEtcd::start(&tools, &old, "default", dir.path().join("b.log"))
            .await
            .unwrap();
    let rotating = RotatingClient::connect(&support::etcd::plain_client_config(
        vec![restored.client_url.clone()],
        Duration::from_secs(5),
    ))
    .await
    .unwrap();
    let retention = Retention {
        policy: GcPolicy::LimitBased { max_backups: 100 },
        delta_retention: Duration::ZERO,
    };
    let mut engine = EtcdEngine::new(rotating, store.clone(), Codec::Gzip, retention);
    engine.resume().await.unwrap();
    assert!(engine.base_needed());
    let listed = store.list().await.unwrap();
    assert_eq!(
        listed.len(),
        1,
        "the newer history is out of the layout: {listed:?}"
    );
    assert_eq!(listed[0].snap_name, full.snap_name);
    let aside: Vec<_> = futures::TryStreamExt::try_collect::<Vec<_>>(store.backend().list(Some(
        &object_store::path::Path::from("etcd-warden/diverged"),
    )))
    .await
    .unwrap();
    assert_eq!(aside.len(), 1, "kept, not deleted");

    // The restored etcd's own writes, at revisions the abandoned history also used.
    let mut b = etcd_client::Client::connect([&restored.client_url], None)
        .await
        .unwrap();
    for i in 0..5 {
        b.put(format!("/k/{i:03}"), "new-history", None)
            .await
            .unwrap();
    }
    engine
        .full(&etcd_warden::snapshot::actor::FullKind::Regular)
        .await
        .unwrap();
    assert!(!engine.base_needed());
    for i in 5..10 {
        b.put(format!("/k/{i:03}"), "after-the-new-base", None)
            .await
            .unwrap();
    }
    let want = b
        .get("/k/", Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .unwrap();
    let want_rev = want.header().unwrap().revision();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        engine.collect().await.unwrap();
        let d = engine.flush_delta().await.unwrap();
        if d.is_some_and(|d| d.snapshot.last_revision >= want_rev) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "delta never reached {want_rev}"
        );
    }
    restored.stop().await.unwrap();

    let again = dir.path().join("again");
    etcd_warden::restore::restore(&store, &support::history::restore_options(&again))
        .await
        .unwrap();
    let (kvs, revision) = support::history::dump_restored(&again).await;
    assert_eq!(revision, want_rev);
    let got: Vec<(String, String)> = kvs
        .iter()
        .map(|(k, v, _)| {
            (
                String::from_utf8_lossy(k).into(),
                String::from_utf8_lossy(v).into(),
            )
        })
        .collect();
    let expected: Vec<(String, String)> = want
        .kvs()
        .iter()
        .map(|kv| (kv.key_str().unwrap().into(), kv.value_str().unwrap().into()))
        .collect();
    assert_eq!(got, expected);
    assert!(got.iter().all(|(_, v)| v != "abandoned"));
}

/// The soak's finding at its smallest: the store performs a delta's upload and loses the
/// answer, three times, while new events arrive. Each retry stores the same revisions under the
/// same name, so the store ends with one delta per range and the chain restores; before, each
/// retry was a new delta over the same revisions, and the chain failed with "events out of
/// order".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delta_whose_answers_are_lost_is_stored_again_under_its_own_name() {
    use etcd_warden::snapshot::delta::DeltaWriter;

    let (memory, losing, store) = losing_delta_store(3);
    let mut writer = DeltaWriter::new(Codec::Gzip, 10);
    writer.push((11..=20).map(put_at), chrono::Utc::now());
    let mut rev = 20;
    for attempt in 1..=3 {
        let failed = writer.flush(&store).await;
        assert!(failed.is_err(), "attempt {attempt}: the answer is lost");
        // Events go on arriving between the tries, and the names' clock moves on.
        rev += 1;
        writer.push([put_at(rev)], chrono::Utc::now());
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    assert_eq!(losing.lost(), 3);
    let first = writer.flush(&store).await.unwrap().unwrap();
    assert_eq!((first.start_revision, first.last_revision), (11, 20));
    let second = writer.flush(&store).await.unwrap().unwrap();
    assert_eq!((second.start_revision, second.last_revision), (21, 23));
    assert!(writer.flush(&store).await.unwrap().is_none());

    let listed = SnapshotStore::new(memory, "p").list().await.unwrap();
    let ranges: Vec<_> = listed
        .iter()
        .map(|s| (s.start_revision, s.last_revision))
        .collect();
    assert_eq!(ranges, vec![(11, 20), (21, 23)], "{listed:?}");
    assert_eq!(listed[0].snap_name, first.snap_name);
    // Every event once, in order.
    let mut seen = Vec::new();
    for s in &listed {
        for e in delta::read(&store, s).await.unwrap() {
            seen.push(e.event.revision());
        }
    }
    assert_eq!(seen, (11..=23).collect::<Vec<_>>());
}

/// A delta lost in the same way, then a full snapshot past part of it: the delta is given up,
/// the next one continues the full snapshot, and the latest chain passes over the copy the store
/// kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_delta_given_up_for_a_full_snapshot_leaves_a_chain_that_continues_it() {
    use etcd_warden::snapshot::delta::DeltaWriter;

    let (memory, _losing, store) = losing_delta_store(1);
    let mut writer = DeltaWriter::new(Codec::Gzip, 10);
    writer.push((11..=20).map(put_at), chrono::Utc::now());
    assert!(writer.flush(&store).await.is_err());
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // A full snapshot at 15 (its object stands in for one taken from etcd).
    let full = store.new_snapshot(Kind::Full, 0, 15, Codec::Gzip, false);
    store
        .put_bytes(&full, bytes::Bytes::from_static(b"full"))
        .await
        .unwrap();
    writer.rebase(15);
    let next = writer.flush(&store).await.unwrap().unwrap();
    assert_eq!((next.start_revision, next.last_revision), (16, 20));

    let chain = SnapshotStore::new(memory, "p")
        .latest_chain()
        .await
        .unwrap();
    assert_eq!(chain.full_snapshot.unwrap().last_revision, 15);
    let ranges: Vec<_> = chain
        .delta_snapshots
        .iter()
        .map(|s| (s.start_revision, s.last_revision))
        .collect();
    assert_eq!(ranges, vec![(16, 20)]);
}

/// An in-memory store behind a [`support::losing::LosingStore`] that loses the answers to the
/// next `times` uploads of snapshots: the memory, the losing store, and the snapshot store over
/// it.
fn losing_delta_store(
    times: u32,
) -> (
    std::sync::Arc<dyn object_store::ObjectStore>,
    std::sync::Arc<support::losing::LosingStore>,
    SnapshotStore,
) {
    use support::losing::{LosingStore, Loss};
    let memory: std::sync::Arc<dyn object_store::ObjectStore> =
        std::sync::Arc::new(object_store::memory::InMemory::new());
    let losing = std::sync::Arc::new(LosingStore::new(memory.clone(), ".gz", Loss::Answer, times));
    let store = SnapshotStore::new(losing.clone(), "p");
    (memory, losing, store)
}

/// A put of `/registry/k<rev>` at revision `rev`.
fn put_at(rev: i64) -> etcd_warden::snapshot::delta::Event {
    etcd_warden::snapshot::delta::Event {
        kind: EventType::Put,
        kv: Some(etcd_warden::snapshot::delta::KeyValue {
            key: format!("/registry/k{rev}").into_bytes(),
            create_revision: rev,
            mod_revision: rev,
            version: 1,
            value: b"v".to_vec(),
            lease: 0,
        }),
        prev_kv: None,
    }
}
