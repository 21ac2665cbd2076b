//! `etcd-warden quorum-restore` against real etcd (3.4 and 3.5): a majority of the members
//! killed for good, the freshest survivor rebuilt as a one-member cluster, every write it
//! committed served after; and each refusal (quorum not lost, not an etcd directory, a corrupt
//! WAL, survivors of different clusters, a hand-off in the store, a survivor behind the store)
//! leaving every directory byte-identical.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use etcd_warden::snapshot::take_full;
use etcd_warden::store::Codec;
use sha2::{Digest, Sha256};

use crate::support;
use crate::support::etcd::{EtcdCluster, EtcdMember, Release};
use crate::support::writer::{Ack, Writer};
use crate::support::{cli, file_store};

/// Runs `etcd-warden quorum-restore` with a short probe window.
fn quorum_restore(release: Release, data_dir: &Path, more: &[&str]) -> Output {
    // The test process's ETCD_WARDEN_* left out: this run is configured by its flags alone.
    let mut c = crate::support::warden::command();
    c.arg("quorum-restore")
        .arg("--data-dir")
        .arg(data_dir)
        .args(["--lost-for", "1s", "--probe-interval", "300ms"])
        .arg("--etcd-bin")
        .arg(release.bin_dir())
        .args(more);
    c.output().expect("run etcd-warden")
}

/// Every file under `dir` (and `dir`'s siblings' names) → its SHA-256: a directory compared
/// before and after a refusal.
fn tree(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Vec<u8>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                let bytes = std::fs::read(&p).unwrap();
                out.insert(
                    p.strip_prefix(root).unwrap().to_path_buf(),
                    Sha256::digest(&bytes).to_vec(),
                );
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// Names beside `dir` (a refusal must leave no `.before-quorum-restore-*` or work directory).
fn siblings(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// A refusal: exit 1, the message contains each of `wanted`, nothing changed.
fn refused(
    out: &Output,
    wanted: &[&str],
    dirs: &[&Path],
    before: &[BTreeMap<PathBuf, Vec<u8>>],
    beside: &[String],
) {
    let printed = cli::printed(out);
    assert_eq!(out.status.code(), Some(1), "{printed}");
    for w in wanted {
        assert!(printed.contains(w), "wanted {w:?} in: {printed}");
    }
    for (dir, was) in dirs.iter().zip(before) {
        assert_eq!(&tree(dir), was, "{} changed by a refusal", dir.display());
    }
    assert_eq!(
        siblings(dirs[0]),
        beside,
        "a refusal left something beside {}",
        dirs[0].display()
    );
}

fn file_url(dir: &Path) -> String {
    format!("file://{}", dir.display())
}

/// The index of the member that leads.
async fn leader(cluster: &EtcdCluster) -> usize {
    for (i, m) in cluster.members.iter().enumerate() {
        let mut c = etcd_client::Client::connect([m.client_url()], None)
            .await
            .unwrap();
        let s = c.status().await.unwrap();
        if s.header().unwrap().member_id() == s.leader() {
            return i;
        }
    }
    panic!("no leader");
}

/// The number `quorum-restore` printed as what a restore from the store would have lost.
fn would_lose(printed: &str) -> i64 {
    let at = printed
        .find("would have lost ")
        .unwrap_or_else(|| panic!("no count of lost revisions in: {printed}"));
    printed[at + "would have lost ".len()..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// Three members under a writer; a full snapshot in the store early on; two members killed
/// for good, then the survivor's etcd stopped. quorum-restore on the survivor (the leader, so
/// every acknowledged write is committed in its log): every acknowledged write is served after
/// with its revision, and the count a restore from the store would have lost is printed.
/// Waits until `writer` has `n` acknowledged puts.
async fn acked(writer: &Writer, n: usize) {
    while writer.ack_count() < n {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Kills every member but those in `keep`, lets `writer` (on `keep[0]`) see its writes fail,
/// stops it, then kills `keep[0]` too: the acknowledged writes, those before the loss.
async fn lose_quorum(cluster: &mut EtcdCluster, keep: &[usize], writer: &mut Writer) -> Vec<Ack> {
    for (i, m) in cluster.members.iter_mut().enumerate() {
        if !keep.contains(&i) {
            m.kill();
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    writer.stop().await;
    let acks = writer.acks();
    cluster.members[keep[0]].kill();
    acks
}

/// The name of the original `data_dir` kept aside beside it, which holds `original` byte for
/// byte (`said`: what the restore printed or logged).
fn kept_original(data_dir: &Path, original: &BTreeMap<PathBuf, Vec<u8>>, said: &str) -> String {
    let kept = siblings(data_dir)
        .into_iter()
        .find(|n| n.contains(".before-quorum-restore-"))
        .unwrap_or_else(|| panic!("no original kept: {said}"));
    assert_eq!(tree(&data_dir.parent().unwrap().join(&kept)), *original);
    kept
}

/// Starts `member` on its restored directory and connects to it: a cluster of itself alone,
/// the one member it lists.
async fn restarted_alone(member: &mut EtcdMember) -> (etcd_client::Client, etcd_client::Member) {
    member.start();
    member.wait_healthy(Duration::from_secs(30)).await;
    let mut c = etcd_client::Client::connect([member.client_url()], None)
        .await
        .unwrap();
    let members = c.member_list().await.unwrap();
    assert_eq!(members.members().len(), 1);
    let alone = members.members()[0].clone();
    (c, alone)
}

async fn three_members_two_lost(release: Release) {
    let mut cluster = EtcdCluster::start(3, release).await;
    let lead = leader(&cluster).await;
    let store_dir = cluster.dir.path().join("store");
    let store = file_store(&store_dir);
    let mut writer = Writer::start(
        cluster.members[lead].client_url(),
        "/q".into(),
        Instant::now(),
        Duration::from_millis(2),
    );
    acked(&writer, 50).await;
    let client = etcd_client::Client::connect([cluster.members[lead].client_url()], None)
        .await
        .unwrap();
    let snap = take_full(&client, &store, Codec::Gzip, false)
        .await
        .unwrap();
    let member_id = {
        let mut c = client.clone();
        c.status().await.unwrap().header().unwrap().member_id()
    };
    acked(&writer, snap.last_revision as usize + 100).await;
    let acks = lose_quorum(&mut cluster, &[lead], &mut writer).await;

    let data_dir = cluster.members[lead].data_dir.clone();
    let original = tree(&data_dir);
    let out = quorum_restore(release, &data_dir, &["--store", &file_url(&store_dir)]);
    let printed = cli::printed(&out);
    assert!(out.status.success(), "{printed}");
    assert!(
        printed.contains(&format!("chose {}", data_dir.display())),
        "{printed}"
    );
    assert!(printed.contains("members dropped: "), "{printed}");
    // The original is kept aside, byte for byte.
    let kept = kept_original(&data_dir, &original, &printed);
    assert!(printed.contains(&kept), "{printed}");

    // etcd's own --force-new-cluster on this member's copy: the same member, alone.
    let (mut c, alone) = restarted_alone(&mut cluster.members[lead]).await;
    assert!(
        printed.contains("with etcd --force-new-cluster on a copy"),
        "{printed}"
    );
    assert_eq!(alone.id(), member_id);
    let last = acks.last().unwrap().revision;
    for ack in &acks {
        let got = c.get(ack.key.as_str(), None).await.unwrap();
        let kv = got.kvs().first().unwrap_or_else(|| {
            panic!(
                "acknowledged {} (revision {}) is not served",
                ack.key, ack.revision
            )
        });
        assert_eq!(kv.mod_revision(), ack.revision, "{}", ack.key);
    }
    let revision = support::etcd::revision(&mut c, "/q").await;
    assert!(
        revision >= last,
        "serves revision {revision}, the last ack was {last}"
    );
    assert_eq!(
        would_lose(&printed),
        revision - snap.last_revision,
        "{printed}"
    );
    assert!(would_lose(&printed) >= 100, "{printed}");
    // It takes writes again.
    c.put("/after", "yes", None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn three_members_two_lost_etcd_35() {
    three_members_two_lost(Release::V35).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn three_members_two_lost_etcd_34() {
    three_members_two_lost(Release::V34).await;
}

/// Needs `$ETCD36_BIN_DIR` (skipped without it, as in CI).
#[tokio::test(flavor = "multi_thread")]
async fn three_members_two_lost_etcd_36() {
    if let Some(release) = Release::v36("three_members_two_lost_etcd_36") {
        three_members_two_lost(release).await;
    }
}

/// Five members, three lost: one survivor stopped early (stale), the leader later (fresh).
/// quorum-restore on the stale one's directory with the fresh one's as another survivor
/// chooses the fresher and rebuilds it as the stale member (its name and peer URL), with a
/// revision bump; every acknowledged write is served.
#[tokio::test(flavor = "multi_thread")]
async fn five_members_three_lost_the_fresher_survivor_is_chosen() {
    let release = Release::V35;
    let mut cluster = EtcdCluster::start(5, release).await;
    let lead = leader(&cluster).await;
    let stale = (lead + 1) % 5;
    let mut writer = Writer::start(
        cluster.members[lead].client_url(),
        "/f".into(),
        Instant::now(),
        Duration::from_millis(2),
    );
    acked(&writer, 30).await;
    cluster.members[stale].kill();
    let at_stale = writer.ack_count();
    acked(&writer, at_stale + 60).await;
    let acks = lose_quorum(&mut cluster, &[lead, stale], &mut writer).await;

    let stale_dir = cluster.members[stale].data_dir.clone();
    let fresh_dir = cluster.members[lead].data_dir.clone();
    let fresh_before = tree(&fresh_dir);
    let out = quorum_restore(
        release,
        &stale_dir,
        &[
            "--survivor-data-dir",
            fresh_dir.to_str().unwrap(),
            "--bump-revision",
            "1000",
            "--mark-compacted",
        ],
    );
    let printed = cli::printed(&out);
    assert!(out.status.success(), "{printed}");
    assert!(
        printed.contains(&format!("chose {}", fresh_dir.display())),
        "{printed}"
    );
    let committed = |dir: &Path| -> u64 {
        let line = format!("survivor {}: committed raft index ", dir.display());
        let at = printed
            .find(&line)
            .unwrap_or_else(|| panic!("{line} in {printed}"));
        printed[at + line.len()..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert!(committed(&fresh_dir) > committed(&stale_dir), "{printed}");
    assert!(
        printed.contains("bumped by 1000, marked compacted"),
        "{printed}"
    );
    // The other survivor's directory is only read.
    assert_eq!(tree(&fresh_dir), fresh_before);

    let (mut c, alone) = restarted_alone(&mut cluster.members[stale]).await;
    assert_eq!(alone.name(), cluster.members[stale].name);
    for ack in &acks {
        let got = c.get(ack.key.as_str(), None).await.unwrap();
        assert!(
            !got.kvs().is_empty(),
            "acknowledged {} (revision {}) is not served",
            ack.key,
            ack.revision
        );
    }
    let revision = support::etcd::revision(&mut c, "/f").await;
    assert!(
        revision > acks.last().unwrap().revision + 1000 - 1,
        "{revision}"
    );
}

/// Every refusal on one three-member cluster's directories, each leaving them unchanged.
#[tokio::test(flavor = "multi_thread")]
async fn refusals_leave_every_directory_unchanged() {
    let release = Release::V35;
    let mut cluster = EtcdCluster::start(3, release).await;
    let root = cluster.dir.path().to_path_buf();
    let mut c = cluster.client().await;
    for i in 0..10 {
        c.put(format!("/r/{i}"), "v", None).await.unwrap();
    }
    // m0 stopped while m1 and m2 serve: quorum is not lost.
    cluster.members[0].kill();
    let m0 = cluster.members[0].data_dir.clone();
    let before = vec![tree(&m0)];
    let beside = siblings(&m0);
    let out = quorum_restore(release, &m0, &[]);
    refused(
        &out,
        &["quorum is not lost", "m1 (", "m2 ("],
        &[&m0],
        &before,
        &beside,
    );

    // The store moves on past m0: a snapshot at a later revision; another store holds a
    // hand-off's final.
    let mut c = etcd_client::Client::connect([cluster.members[1].client_url()], None)
        .await
        .unwrap();
    // m0 may have led: the first puts wait out an election.
    for i in 10..30 {
        let deadline = Instant::now() + Duration::from_secs(20);
        while let Err(e) = c.put(format!("/r/{i}"), "v", None).await {
            assert!(Instant::now() < deadline, "put /r/{i}: {e}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let ahead_dir = root.join("ahead-store");
    let ahead = take_full(&c, &file_store(&ahead_dir), Codec::Gzip, false)
        .await
        .unwrap();
    let final_dir = root.join("final-store");
    take_full(&c, &file_store(&final_dir), Codec::Gzip, true)
        .await
        .unwrap();
    // A member whose etcd runs: its database is locked.
    let m1 = cluster.members[1].data_dir.clone();
    let m1_beside = siblings(&m1);
    let out = quorum_restore(release, &m1, &[]);
    assert_eq!(out.status.code(), Some(1), "{}", cli::printed(&out));
    assert!(
        cli::printed(&out).contains(&format!(
            "{} is in use: etcd holds its database's lock",
            m1.display()
        )),
        "{}",
        cli::printed(&out)
    );
    assert_eq!(siblings(&m1), m1_beside);
    cluster.members[1].kill();
    cluster.members[2].kill();
    let beside = siblings(&m0);

    // A hand-off in the store.
    let out = quorum_restore(release, &m0, &["--store", &file_url(&final_dir)]);
    refused(
        &out,
        &["refusing to revive this member", "final"],
        &[&m0],
        &before,
        &beside,
    );

    // The survivor is behind the store's newest snapshot.
    let out = quorum_restore(release, &m0, &["--store", &file_url(&ahead_dir)]);
    refused(
        &out,
        &[
            "behind the store's newest snapshot",
            &ahead.snap_name,
            "use `etcd-warden restore`",
        ],
        &[&m0],
        &before,
        &beside,
    );

    // A survivor of another cluster.
    let mut other = EtcdCluster::single(release).await;
    other.members[0].kill();
    let other_dir = other.members[0].data_dir.clone();
    let other_before = tree(&other_dir);
    let out = quorum_restore(
        release,
        &m0,
        &["--survivor-data-dir", other_dir.to_str().unwrap()],
    );
    refused(
        &out,
        &[
            "disagree",
            "different clusters",
            other_dir.to_str().unwrap(),
        ],
        &[&m0, &other_dir],
        &[before[0].clone(), other_before],
        &beside,
    );

    // Not an etcd data directory.
    let junk = root.join("junk");
    std::fs::create_dir_all(junk.join("member")).unwrap();
    std::fs::write(junk.join("member/notes"), "not etcd").unwrap();
    let junk_before = vec![tree(&junk)];
    let junk_beside = siblings(&junk);
    let out = quorum_restore(release, &junk, &[]);
    refused(
        &out,
        &[&format!("{} is not an etcd data directory", junk.display())],
        &[&junk],
        &junk_before,
        &junk_beside,
    );

    // A corrupt WAL: one byte flipped in a record of a copy of m0.
    let corrupt = root.join("corrupt.etcd");
    copy(&m0, &corrupt);
    let wal_dir = corrupt.join("member/wal");
    let segment = std::fs::read_dir(&wal_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "wal"))
        .min()
        .unwrap();
    let mut bytes = std::fs::read(&segment).unwrap();
    bytes[100] ^= 0x40;
    std::fs::write(&segment, &bytes).unwrap();
    let corrupt_before = vec![tree(&corrupt)];
    let corrupt_beside = siblings(&corrupt);
    let out = quorum_restore(release, &corrupt, &[]);
    refused(
        &out,
        &["corrupt WAL", segment.to_str().unwrap()],
        &[&corrupt],
        &corrupt_before,
        &corrupt_beside,
    );

    // --force rebuilds from the survivor behind the store, and says what the store holds.
    let out = quorum_restore(release, &m0, &["--store", &file_url(&ahead_dir), "--force"]);
    let printed = cli::printed(&out);
    assert!(out.status.success(), "{printed}");
    assert!(printed.contains("would have lost 0 revisions"), "{printed}");
}

fn copy(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        let dest = to.join(p.file_name().unwrap());
        if p.is_dir() {
            copy(&p, &dest);
        } else {
            std::fs::copy(&p, &dest).unwrap();
        }
    }
}

/// Waits until `w` logged `what` (the log so far otherwise, in the panic).
async fn logged(w: &crate::support::warden::Warden, what: &str, timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let text = w.log_text();
        if text.contains(what) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "etcd-warden never logged {what:?}:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `serve` with `quorum_restore.machine`: before etcd starts, the sidecar carries out the
/// operator's quorum restore request (the `EtcdQuorum` in the API-server double) when it names
/// this machine and was accepted, and leaves the data directory byte-identical when it names
/// another. Three members of etcd 3.5, two killed for good, the survivor's etcd stopped (as it
/// is in a restarted pod until the sidecar answers /livez): after the sidecar's rebuild, etcd
/// started on the directory serves alone every write made before the loss.
///
/// What the double does not check: no pod, no kubelet (the test starts etcd once the sidecar
/// is up, as the pod's ordering would); no RBAC on the sidecar's read; the status is written
/// by the test as the operator would (`operator_kube` shows the operator writing it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_rebuilds_before_etcd_starts_when_the_request_names_its_machine() {
    use crate::support::apiserver::ApiServer;
    use crate::support::warden::Warden;
    use etcd_warden::operator::quorum::resource::{EtcdQuorum, EtcdQuorumSpec, QuorumRestoreSpec};
    use kube::api::{Api, Patch, PatchParams, PostParams};

    let release = Release::V35;
    let mut cluster = EtcdCluster::start(3, release).await;
    let lead = leader(&cluster).await;
    let mut c = etcd_client::Client::connect([cluster.members[lead].client_url()], None)
        .await
        .unwrap();
    for i in 0..30 {
        c.put(format!("/q/{i:03}"), format!("v{i}"), None)
            .await
            .unwrap();
    }
    drop(c);
    for (i, m) in cluster.members.iter_mut().enumerate() {
        if i != lead {
            m.kill();
        }
    }
    // The leader acknowledges a write once applied, and may persist the commit index that
    // covers it a moment later; a member stopped in that moment loses it (etcd's semantics).
    tokio::time::sleep(Duration::from_millis(300)).await;
    cluster.members[lead].kill();
    let data_dir = cluster.members[lead].data_dir.clone();
    let original = tree(&data_dir);
    let beside = siblings(&data_dir);

    let server = ApiServer::start().await;
    server.status_subresource("etcd-warden.io", "etcdquorums");
    // Beside the data directories nothing but what the rebuild leaves.
    let side = tempfile::tempdir().unwrap();
    let kubeconfig = side.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig, "openshift-etcd");
    let api: Api<EtcdQuorum> = Api::namespaced(server.client(), "openshift-etcd");
    let ask = |survivor: &str| EtcdQuorumSpec {
        quorum_restore: Some(QuorumRestoreSpec {
            survivor: survivor.into(),
        }),
    };
    api.create(
        &PostParams::default(),
        &EtcdQuorum::new("cluster", ask("cp-1")),
    )
    .await
    .unwrap();
    // As the operator accepts a request while quorum is lost.
    let accept = async |survivor: &str| {
        let status = serde_json::json!({"status": {
            "desiredVoters": 3, "voters": 0, "learners": 0,
            "quorumRestore": {"survivor": survivor, "phase": "WaitingForRebuild"},
        }});
        api.patch_status("cluster", &PatchParams::default(), &Patch::Merge(&status))
            .await
            .unwrap();
    };
    accept("cp-1").await;

    let keys = [
        ("quorum_restore.machine", "cp-0".to_string()),
        (
            "quorum_restore.kubeconfig",
            kubeconfig.display().to_string(),
        ),
        ("quorum_restore.lost_for", "1s".to_string()),
        ("quorum_restore.probe_interval", "300ms".to_string()),
        ("restore.data_dir", data_dir.display().to_string()),
        ("restore.etcd_bin", release.bin_dir().display().to_string()),
        ("store.url", file_url(&side.path().join("store"))),
        ("etcd.endpoints", cluster.members[lead].client_url()),
    ];
    // Another machine named: nothing happens.
    let mut w = Warden::start(&keys);
    let log = logged(&w, "etcd-warden serving", Duration::from_secs(30)).await;
    w.kill();
    assert!(!log.contains("rebuilding before etcd starts"), "{log}");
    assert_eq!(
        tree(&data_dir),
        original,
        "changed for another machine's request"
    );
    assert_eq!(siblings(&data_dir), beside);

    // This machine named and accepted: rebuilt before the sidecar serves.
    api.patch(
        "cluster",
        &PatchParams::default(),
        &Patch::Merge(&serde_json::json!({"spec": {"quorumRestore": {"survivor": "cp-0"}}})),
    )
    .await
    .unwrap();
    accept("cp-0").await;
    let mut w = Warden::start(&keys);
    let log = logged(&w, "etcd-warden serving", Duration::from_secs(90)).await;
    w.kill();
    assert!(log.contains("quorum restored"), "{log}");
    kept_original(&data_dir, &original, &log);

    let (mut c, _) = restarted_alone(&mut cluster.members[lead]).await;
    for i in 0..30 {
        let got = c.get(format!("/q/{i:03}"), None).await.unwrap();
        assert_eq!(
            got.kvs().first().map(|kv| kv.value().to_vec()),
            Some(format!("v{i}").into_bytes()),
            "/q/{i:03}"
        );
    }
}
