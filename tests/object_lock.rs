//! Object-lock aware retention against a real S3 Object Lock implementation: moto's server
//! (`moto_server`) on loopback. Snapshots written by etcd-warden's store with
//! `store.object_lock_retention` carry a retention date on every write path (multipart, single
//! `PUT`, a delta's `PUT`); a retention pass that wants them gone keeps them (still listed, still
//! readable, no delete marker hiding them), succeeds, counts them and logs each once; once the
//! retention ends or the legal hold is lifted, the next pass deletes them.
//!
//! What moto does not enforce, so this test cannot show: request signatures (any credentials
//! pass), the IAM permissions `HEAD` needs to return the lock headers (`s3:GetObjectRetention`,
//! `s3:GetObjectLegalHold`), the difference between governance and compliance (bypassing a
//! governance lock with `x-amz-bypass-governance-retention`, never shortening a compliance
//! date), and AWS's `Content-MD5` requirement on locked writes (sent anyway). GCS retention
//! and Azure immutability have no local server that enforces them (azurite deletes a blob under
//! a policy), so their refusals are unit tests of `store::object_lock`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use chrono::Utc;
use etcd_warden::config::{GcPolicy, ObjectLockMode, ObjectLockRetention};
use etcd_warden::snapshot::metrics::SnapshotMetrics;
use etcd_warden::store::gc::{self, Retention};
use etcd_warden::store::{Codec, Kind, Snapshot, SnapshotStore};
use futures::StreamExt;

use crate::support::eventually;
use crate::support::moto::MotoServer;

const BUCKET: &str = "locked-backups";
const PREFIX: &str = "etcd/main";
/// Short, so the test sees it end; S3 takes any period.
const PERIOD: Duration = Duration::from_secs(4);

/// A `tracing` writer into a shared buffer: what the log said.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Log {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

fn names(v: &[Snapshot]) -> Vec<(Kind, i64)> {
    v.iter().map(|s| (s.kind, s.last_revision)).collect()
}

fn payload(tag: &str) -> Bytes {
    Bytes::from(format!("payload of {tag}").into_bytes())
}

async fn read(store: &SnapshotStore, s: &Snapshot) -> Bytes {
    let mut out = Vec::new();
    let mut stream = store.get_stream(s).await.expect("read snapshot");
    while let Some(chunk) = stream.next().await {
        out.extend_from_slice(&chunk.expect("read snapshot"));
    }
    Bytes::from(out)
}

fn one_chunk(b: Bytes) -> etcd_warden::store::ByteStream {
    futures::stream::iter([Ok(b)]).boxed()
}

#[tokio::test]
async fn a_locked_snapshot_survives_retention_and_the_pass_succeeds() {
    let log = Log::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let moto = MotoServer::start();
    moto.create_locked_bucket(BUCKET).await;
    let mut config = moto.store_config(BUCKET, PREFIX);
    let plain = SnapshotStore::from_config(&config).unwrap();
    config.object_lock = Some(ObjectLockRetention {
        mode: ObjectLockMode::Governance,
        period: PERIOD,
    });
    let locking = SnapshotStore::from_config(&config).unwrap();

    // Oldest stream locked (a full by multipart upload, a delta by PUT), the next one not
    // (its full will carry a legal hold), the newest full locked, by single PUT.
    let full_a = locking.new_snapshot(Kind::Full, 0, 10, Codec::None, false);
    let delta_b = locking.new_snapshot(Kind::Incr, 11, 12, Codec::None, false);
    let full_c = plain.new_snapshot(Kind::Full, 0, 20, Codec::None, false);
    let delta_e = plain.new_snapshot(Kind::Incr, 21, 22, Codec::None, false);
    let full_d = locking.new_snapshot(Kind::Full, 0, 30, Codec::None, false);
    locking
        .put_stream(&full_a, one_chunk(payload("A")))
        .await
        .unwrap();
    locking.put_bytes(&delta_b, payload("B")).await.unwrap();
    plain.put_bytes(&full_c, payload("C")).await.unwrap();
    plain.put_bytes(&delta_e, payload("E")).await.unwrap();
    let d = payload("D");
    let len = d.len() as u64;
    locking
        .put_stream_sized(&full_d, one_chunk(d), len)
        .await
        .unwrap();
    for (s, locked) in [
        (&full_a, true),
        (&delta_b, true),
        (&full_c, false),
        (&delta_e, false),
        (&full_d, true),
    ] {
        let lock = locking.lock(s).await.unwrap();
        assert_eq!(lock.is_some(), locked, "{}: {lock:?}", s.snap_name);
        if let Some(lock) = lock {
            let until = lock.retain_until.expect("a retention date");
            let ahead = until - Utc::now();
            assert!(
                ahead > chrono::TimeDelta::zero() && ahead <= chrono::TimeDelta::seconds(6),
                "{}: retained until {until}",
                s.snap_name
            );
        }
    }
    let key_c = locking.path_of(&full_c).to_string();
    moto.legal_hold(BUCKET, &key_c, true).await;

    // Keep one full snapshot: everything but D is due.
    let retention = Retention {
        policy: GcPolicy::LimitBased { max_backups: 1 },
        delta_retention: Duration::ZERO,
    };
    let metrics = SnapshotMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let rendered = || {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        out
    };

    let report = gc::run(&locking, Utc::now(), retention)
        .await
        .expect("the pass succeeds");
    metrics.gc(&report);
    assert_eq!(names(&report.deleted), vec![(Kind::Incr, 22)]);
    assert_eq!(
        names(&report.locked),
        vec![(Kind::Incr, 12), (Kind::Full, 10), (Kind::Full, 20)]
    );
    assert!(report.failed.is_empty(), "{report:?}");
    assert!(
        rendered().contains("etcd_warden_gc_locked_objects 3"),
        "{}",
        rendered()
    );
    // Still listed, still readable, and not hidden behind a delete marker.
    assert_eq!(
        names(&locking.list().await.unwrap()),
        vec![
            (Kind::Full, 10),
            (Kind::Incr, 12),
            (Kind::Full, 20),
            (Kind::Full, 30)
        ]
    );
    assert_eq!(read(&locking, &full_a).await, payload("A"));
    assert_eq!(read(&locking, &delta_b).await, payload("B"));
    let key_a = locking.path_of(&full_a).to_string();
    assert_eq!(moto.versions(BUCKET, &key_a).await, (1, false));

    // A second pass keeps them again and does not log them again.
    let again = gc::run(&locking, Utc::now(), retention).await.unwrap();
    assert_eq!(again.locked, report.locked);
    let text = log.text();
    for s in [&full_a, &delta_b, &full_c] {
        let lines = text
            .lines()
            .filter(|l| l.contains(&s.snap_name) && l.contains("retention: kept"))
            .count();
        assert_eq!(lines, 1, "{} logged {lines} times:\n{text}", s.snap_name);
    }
    assert!(
        text.contains("under legal hold"),
        "the hold is named:\n{text}"
    );

    // The retention ends: A and B go; C stays under its legal hold.
    assert!(
        eventually(Duration::from_secs(20), || async {
            locking.lock(&full_a).await.unwrap().is_none()
                && locking.lock(&delta_b).await.unwrap().is_none()
        })
        .await,
        "the retention did not end"
    );
    let report = gc::run(&locking, Utc::now(), retention).await.unwrap();
    metrics.gc(&report);
    assert_eq!(
        names(&report.deleted),
        vec![(Kind::Incr, 12), (Kind::Full, 10)]
    );
    assert_eq!(names(&report.locked), vec![(Kind::Full, 20)]);
    assert!(rendered().contains("etcd_warden_gc_locked_objects 1"));
    // On a versioned bucket the delete hides the data behind a marker; a lifecycle rule for
    // noncurrent versions removes it (docs/operations.md).
    assert_eq!(moto.versions(BUCKET, &key_a).await, (1, true));

    // The hold is lifted: C goes, D (the newest) stays.
    moto.legal_hold(BUCKET, &key_c, false).await;
    let report = gc::run(&locking, Utc::now(), retention).await.unwrap();
    metrics.gc(&report);
    assert_eq!(names(&report.deleted), vec![(Kind::Full, 20)]);
    assert!(report.locked.is_empty() && report.failed.is_empty());
    assert!(rendered().contains("etcd_warden_gc_locked_objects 0"));
    assert_eq!(
        names(&locking.list().await.unwrap()),
        vec![(Kind::Full, 30)]
    );
}

/// The keys are refused, naming the key, where they cannot work.
#[test]
fn object_lock_keys_are_checked_and_refused_off_s3() {
    // (keys, the key the error names, what its message says)
    type Case<'a> = (Vec<(&'a str, &'a str)>, &'a str, &'a str);
    let cases: Vec<Case> = vec![
        (
            vec![
                ("store.url", "gs://b/p"),
                ("store.object_lock_retention", "720h"),
            ],
            "store.object_lock_retention",
            "bucket",
        ),
        (
            vec![
                ("store.url", "az://c/p"),
                ("store.object_lock_retention", "720h"),
            ],
            "store.object_lock_retention",
            "container",
        ),
        (
            vec![
                ("store.url", "s3://b/p"),
                ("store.object_lock_retention", "a month"),
            ],
            "store.object_lock_retention",
            "",
        ),
        (
            vec![
                ("store.url", "s3://b/p"),
                ("store.object_lock_retention", "0s"),
            ],
            "store.object_lock_retention",
            "greater than zero",
        ),
        (
            vec![
                ("store.url", "s3://b/p"),
                ("store.object_lock_retention", "720h"),
                ("store.object_lock_mode", "strict"),
            ],
            "store.object_lock_mode",
            "compliance",
        ),
        (
            vec![
                ("store.url", "s3://b/p"),
                ("store.object_lock_mode", "compliance"),
            ],
            "store.object_lock_mode",
            "store.object_lock_retention",
        ),
    ];
    let load = |keys: &[(&str, &str)]| {
        let sources = etcd_warden::config::Sources {
            file: None,
            env: &std::collections::HashMap::<String, String>::new(),
            overrides: keys
                .iter()
                .map(|(k, v)| etcd_warden::config::Override::flag(k, *v, "test"))
                .collect(),
        };
        etcd_warden::config::Config::load_for(&sources, etcd_warden::config::Purpose::Any)
    };
    for (keys, named, says) in cases {
        let e = load(&keys).expect_err(named);
        assert_eq!(e.key, named, "{keys:?}: {e}");
        assert!(e.to_string().contains(says), "{keys:?}: {e}");
    }
    let c = load(&[
        ("store.url", "s3://b/p"),
        ("store.object_lock_retention", "720h"),
        ("store.object_lock_mode", "Compliance"),
    ])
    .unwrap();
    assert_eq!(
        c.0.store.object_lock,
        Some(ObjectLockRetention {
            mode: ObjectLockMode::Compliance,
            period: Duration::from_secs(720 * 3600),
        })
    );
    let c = load(&[
        ("store.url", "s3://b/p"),
        ("store.object_lock_retention", "30d"),
    ])
    .unwrap();
    assert_eq!(
        c.0.store.object_lock.map(|l| l.mode),
        Some(ObjectLockMode::Governance)
    );
}

/// On an S3-compatible service without Object Lock (s3s-fs), reading the lock first finds none
/// and retention deletes as before.
#[tokio::test]
async fn retention_on_a_store_without_object_lock_deletes_as_before() {
    let s3 = crate::support::s3::S3Server::start(&["plain-bucket"]);
    let store = SnapshotStore::from_config(&s3.store_config("plain-bucket", PREFIX)).unwrap();
    let old = store.new_snapshot(Kind::Full, 0, 10, Codec::None, false);
    let delta = store.new_snapshot(Kind::Incr, 11, 12, Codec::None, false);
    let new = store.new_snapshot(Kind::Full, 0, 20, Codec::None, false);
    for s in [&old, &delta, &new] {
        store.put_bytes(s, payload(&s.snap_name)).await.unwrap();
        assert_eq!(store.lock(s).await.unwrap(), None);
    }
    let retention = Retention {
        policy: GcPolicy::LimitBased { max_backups: 1 },
        delta_retention: Duration::ZERO,
    };
    let report = gc::run(&store, Utc::now(), retention).await.unwrap();
    assert_eq!(
        names(&report.deleted),
        vec![(Kind::Incr, 12), (Kind::Full, 10)]
    );
    assert!(report.locked.is_empty() && report.failed.is_empty());
    assert_eq!(names(&store.list().await.unwrap()), vec![(Kind::Full, 20)]);
}

/// The sidecar configured with `store.object_lock_retention` writes its snapshots locked; its
/// retention, running every 200 ms, keeps the locked full snapshots it wants gone, counts them
/// in `/metrics` and logs each once over many passes. (Requested full snapshots are counted
/// apart from scheduled ones: with `max_backups = 1` it wants the two older of the three
/// requested gone, and keeps the scheduled one and the newest requested.)
#[tokio::test(flavor = "multi_thread")]
async fn the_sidecar_writes_locked_snapshots_and_its_retention_keeps_them() {
    use crate::support::etcd::{EtcdCluster, Release};
    use crate::support::warden::Warden;

    let etcd = EtcdCluster::single(Release::V35).await;
    let mut client = etcd.client().await;
    let moto = MotoServer::start();
    moto.create_locked_bucket(BUCKET).await;
    let w = Warden::start(&[
        ("etcd.endpoints", etcd.endpoints()[0].clone()),
        ("store.url", format!("s3://{BUCKET}/{PREFIX}")),
        ("store.endpoint", moto.endpoint()),
        ("store.region", crate::support::moto::REGION.into()),
        ("store.access_key_id", "moto-access".into()),
        ("store.secret_access_key", "moto-secret".into()),
        ("store.object_lock_retention", "1h".into()),
        ("store.object_lock_mode", "compliance".into()),
        ("snapshot.gc_policy", "LimitBased".into()),
        ("snapshot.max_backups", "1".into()),
        ("snapshot.gc_period", "200ms".into()),
        ("snapshot.delta_period", "0s".into()),
    ]);
    w.wait_up().await;
    let http = reqwest::Client::new();
    for i in 0..3 {
        client.put(format!("/lock/{i}"), "v", None).await.unwrap();
        // Names carry whole seconds: one snapshot per second keeps them distinct.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let r = http.post(w.url("/snapshot/full")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 201, "{}", w.log_text());
    }
    // The sidecar's own first full snapshot and the three asked for.
    let store = SnapshotStore::from_config(&moto.store_config(BUCKET, PREFIX)).unwrap();
    let taken = store.list().await.unwrap();
    assert_eq!(taken.len(), 4, "{taken:?}");
    for s in &taken {
        let lock = store.lock(s).await.unwrap();
        let until = lock.and_then(|l| l.retain_until);
        assert!(
            until.is_some_and(|u| u > Utc::now() + chrono::TimeDelta::minutes(59)),
            "{} is retained until {until:?}",
            s.snap_name
        );
    }
    // Retention wants the two older requested ones gone; they stay, counted, over several passes.
    let counted = eventually(Duration::from_secs(10), || async {
        let Some((_, metrics)) = w.get("/metrics").await else {
            return false;
        };
        metrics
            .as_str()
            .is_some_and(|m| m.contains("etcd_warden_gc_locked_objects 2"))
    })
    .await;
    assert!(counted, "{}", w.log_text());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(store.list().await.unwrap(), taken);
    let log = w.log_text();
    for s in &taken[1..3] {
        let lines = log
            .lines()
            .filter(|l| l.contains(&s.snap_name) && l.contains("retention: kept"))
            .count();
        assert_eq!(lines, 1, "{} logged {lines} times:\n{log}", s.snap_name);
    }
    // About five passes ran since the count was first seen: still one line per snapshot.
    assert_eq!(log.matches("retention: kept").count(), 2, "{log}");
    assert!(!log.contains("retention: delete failed"), "{log}");
}
