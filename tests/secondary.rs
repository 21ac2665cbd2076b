//! `[store.secondary]`: the sidecar copies every snapshot of its primary store to a secondary,
//! keeps up under a writer, and rides out the secondary being down without the primary slowing
//! or etcd becoming unready.

use crate::support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use etcd_warden::store::SnapshotStore;
use support::etcd::{EtcdCluster, Release};
use support::eventually;
use support::s3::S3Server;
use support::warden::Warden;
use support::writer::Writer;

const BUCKET: &str = "secondary";
/// How long the secondary's server is down: long enough for several deltas (one a second) and
/// several failed sync passes, short enough for the suite. A minute-long outage shows nothing
/// more: the sync task's retries are backed off and never touch the primary path either way.
const OUTAGE: Duration = Duration::from_secs(8);

/// Snapshot names without `.final` (the secondary holds a final under its plain name).
async fn names(store: &SnapshotStore) -> BTreeSet<String> {
    store
        .list()
        .await
        .map(|l| {
            l.into_iter()
                .map(|s| s.snap_name.trim_end_matches(".final").to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// The value of an unlabelled metric from `/metrics`.
async fn metric(w: &Warden, name: &str) -> Option<f64> {
    let text = reqwest::get(w.url("/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} "))?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_secondary_keeps_up_under_a_writer_and_survives_an_outage_without_the_primary_slowing()
{
    let etcd = EtcdCluster::single(Release::V35).await;
    let mut s3 = S3Server::start(&[BUCKET]);
    let dir = tempfile::tempdir().unwrap();
    let primary_url = format!("file://{}", dir.path().display());
    let primary = SnapshotStore::from_config(&etcd_warden::config::StoreConfig::at(
        etcd_warden::config::StoreLocation::parse(&primary_url).unwrap(),
    ))
    .unwrap();
    let secondary_cfg = s3.store_config(BUCKET, "etcd");
    let secondary = SnapshotStore::from_config(&secondary_cfg).unwrap();

    let mut keys = vec![
        ("etcd.endpoints", etcd.endpoints()[0].clone()),
        ("store.url", primary_url),
        ("snapshot.delta_period", "1s".to_string()),
        ("store.secondary.sync_interval", "500ms".to_string()),
        ("store.secondary.max_lag", "1m".to_string()),
    ];
    let overrides = s3.config_overrides("store.secondary", BUCKET, "etcd");
    for (k, v) in &overrides {
        keys.push((k.as_str(), v.clone()));
    }
    let w = Warden::start(&keys);
    w.wait_up().await;
    let mut writer = Writer::start(
        etcd.endpoints()[0].clone(),
        "/secondary".into(),
        Instant::now(),
        Duration::from_millis(20),
    );

    // Keeps up: under the writer, what the primary held a moment ago reaches the secondary.
    let caught_up = |within| {
        let (primary, secondary) = (&primary, &secondary);
        eventually(within, move || async move {
            let p = names(primary).await;
            let s = names(secondary).await;
            p.len() >= 3 && p.iter().take(p.len() - 2).all(|n| s.contains(n))
        })
    };
    assert!(
        caught_up(Duration::from_secs(30)).await,
        "the secondary did not keep up; log:\n{}",
        w.log_text()
    );
    let failures_before = metric(&w, "etcd_warden_secondary_sync_failures_total")
        .await
        .expect("the secondary's metrics are exported");
    assert_eq!(
        metric(&w, "etcd_warden_secondary_max_lag_seconds").await,
        Some(60.0)
    );

    // The outage: the primary keeps its one-a-second deltas, etcd stays ready.
    let before = names(&primary).await.len();
    s3.stop();
    let started = Instant::now();
    while started.elapsed() < OUTAGE {
        let (status, _) = w.get("/healthz").await.expect("/healthz answers");
        assert_eq!(status, 200, "a down secondary made etcd unready");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let during = names(&primary).await.len() - before;
    let lag_during = metric(&w, "etcd_warden_secondary_lag_seconds")
        .await
        .unwrap();
    s3.resume();
    assert!(
        during as u64 >= OUTAGE.as_secs() - 3,
        "the primary slowed while the secondary was down: {during} snapshots in {OUTAGE:?}"
    );
    assert!(
        lag_during > 0.0,
        "the lag shows the outage (a delta a second was not copied)"
    );
    assert!(
        metric(&w, "etcd_warden_secondary_sync_failures_total")
            .await
            .unwrap()
            > failures_before,
        "the failed passes are counted"
    );

    // Back: the secondary catches up with everything written during the outage.
    assert!(
        caught_up(Duration::from_secs(60)).await,
        "the secondary did not catch up after the outage; log:\n{}",
        w.log_text()
    );
    writer.stop().await;
    let settled = eventually(Duration::from_secs(30), || async {
        names(&primary).await.is_subset(&names(&secondary).await)
            && metric(&w, "etcd_warden_secondary_lag_seconds").await == Some(0.0)
    })
    .await;
    assert!(settled, "the lag returns to 0; log:\n{}", w.log_text());
    assert!(
        !secondary.list().await.unwrap().is_empty() && writer.failures() == 0,
        "the writer never failed"
    );
}

#[tokio::test]
async fn ls_and_verify_read_the_secondary_with_the_flag_and_refuse_it_unconfigured() {
    use etcd_warden::store::Codec;
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let url = |d: &tempfile::TempDir| format!("file://{}", d.path().display());
    let at = |u: &str| {
        SnapshotStore::from_config(&etcd_warden::config::StoreConfig::at(
            etcd_warden::config::StoreLocation::parse(u).unwrap(),
        ))
        .unwrap()
    };
    let on_primary =
        support::stored::put_full(&at(&url(&a)), 10, 1_700_000_000, 64, Codec::Gzip, false).await;
    let on_secondary =
        support::stored::put_full(&at(&url(&b)), 20, 1_700_000_100, 64, Codec::Gzip, false).await;
    let run = |args: &[&str], secondary: Option<String>| {
        let mut c = support::warden::command();
        c.args(args).env("ETCD_WARDEN_STORE_URL", url(&a));
        if let Some(s) = secondary {
            c.env("ETCD_WARDEN_STORE_SECONDARY_URL", s);
        }
        c.output().unwrap()
    };
    let listed = support::cli::printed(&run(&["ls", "--secondary"], Some(url(&b))));
    assert!(listed.contains(&on_secondary.snap_name), "{listed}");
    assert!(!listed.contains(&on_primary.snap_name), "{listed}");
    let listed = support::cli::printed(&run(&["ls"], Some(url(&b))));
    assert!(listed.contains(&on_primary.snap_name), "{listed}");
    let verified = run(&["verify", "--secondary"], Some(url(&b)));
    assert!(
        verified.status.success(),
        "{}",
        support::cli::printed(&verified)
    );

    let refused = support::cli::exited(&run(&["ls", "--secondary"], None), 64);
    assert!(refused.contains("store.secondary.url"), "{refused}");
}

/// `etcd-warden initialize` (one function with `serve`'s `restore.initialize` and etcd-wrapper's
/// initialization under `[druid]`) with an empty primary store restores from the secondary, says
/// so, and the keys are the source's. (Which store is chosen when is `pick_store`'s unit test.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initialize_falls_back_to_the_secondary_when_the_primary_is_empty() {
    let etcd = EtcdCluster::single(Release::V35).await;
    let mut client = etcd.client().await;
    for i in 0..20 {
        client
            .put(format!("/k/{i}"), format!("v{i}"), None)
            .await
            .unwrap();
    }
    let want = support::history::dump(&mut client).await;
    let dir = tempfile::tempdir().unwrap();
    let (primary, secondary) = (dir.path().join("primary"), dir.path().join("secondary"));
    std::fs::create_dir_all(&primary).unwrap();
    let out = support::warden::command()
        .args(["snapshot"])
        .env(
            etcd_warden::config::env_var_for("store.url"),
            format!("file://{}", secondary.display()),
        )
        .env(
            etcd_warden::config::env_var_for("etcd.endpoints"),
            etcd.endpoints()[0].clone(),
        )
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(etcd);

    let data = dir.path().join("data");
    let config = dir.path().join("warden.toml");
    std::fs::write(
        &config,
        format!(
            "[store]\nurl = \"file://{}\"\n[store.secondary]\nurl = \"file://{}\"\n\
             [restore]\ndata_dir = \"{}\"\netcd_bin = \"{}\"\n",
            primary.display(),
            secondary.display(),
            data.display(),
            Release::V35.bin_dir().display()
        ),
    )
    .unwrap();
    let out = support::warden::command()
        .arg("initialize")
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("initializing from the SECONDARY store"),
        "the fallback is not said: {log}"
    );
    let restored = support::history::dump_restored(&data).await;
    assert!(restored == want, "the restored keys differ");
}
