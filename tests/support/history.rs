//! A store's history written from a real etcd: a full snapshot, then deltas taken from a watch,
//! each after a phase of puts, overwrites and a delete; and etcd's content to compare restores with.

use etcd_client::{Client, GetOptions};
use etcd_warden::snapshot::delta::{DeltaWriter, Event};
use etcd_warden::snapshot::take_full;
use etcd_warden::snapshot::watcher::DeltaWatch;
use etcd_warden::store::{Codec, SnapshotStore};

/// Every key as (key, value, mod revision), and the revision.
pub type Dump = (Vec<(Vec<u8>, Vec<u8>, i64)>, i64);

/// Every key and value with its mod revision, and the revision.
pub async fn dump(client: &mut Client) -> Dump {
    dump_as_of(client, None).await
}

/// As [`dump`]; with `revision`, etcd's keys as they were at that revision.
pub async fn dump_as_of(client: &mut Client, revision: Option<i64>) -> Dump {
    let mut options = GetOptions::new().with_from_key();
    if let Some(r) = revision {
        options = options.with_revision(r);
    }
    let resp = client.get(vec![0u8], Some(options)).await.unwrap();
    let kvs = resp
        .kvs()
        .iter()
        .map(|kv| (kv.key().to_vec(), kv.value().to_vec(), kv.mod_revision()))
        .collect();
    (kvs, revision.unwrap_or(resp.header().unwrap().revision()))
}

/// Writes `n` keys of phase `phase` (~200-byte values), overwrites the first, deletes the
/// second; returns the revision after.
pub async fn writes(client: &mut Client, phase: usize, n: usize) -> i64 {
    for i in 0..n {
        client
            .put(
                format!("/registry/secrets/p{phase}-{i:04}"),
                format!("secret-{phase}-{i}-{}", "x".repeat(200)),
                None,
            )
            .await
            .unwrap();
    }
    client
        .put(format!("/registry/secrets/p{phase}-0000"), "rotated", None)
        .await
        .unwrap();
    let r = client
        .delete(format!("/registry/secrets/p{phase}-0001"), None)
        .await
        .unwrap();
    r.header().unwrap().revision()
}

/// A full snapshot after `first` writes, then `deltas` deltas of `per_delta` writes each, written
/// by `store`. Returns the last revision.
pub async fn build(
    client: &mut Client,
    store: &SnapshotStore,
    first: usize,
    deltas: usize,
    per_delta: usize,
) -> i64 {
    let mut rev = writes(client, 0, first).await;
    let full = take_full(client, store, Codec::Gzip, false).await.unwrap();
    assert_eq!(full.last_revision, rev);
    let mut writer = DeltaWriter::new(Codec::Gzip, full.last_revision);
    let mut watch = DeltaWatch::open(client, full.last_revision + 1)
        .await
        .unwrap();
    for phase in 1..=deltas {
        rev = writes(client, phase, per_delta).await;
        let mut events: Vec<Event> = Vec::new();
        while events.last().map_or(0, Event::revision) < rev {
            events.extend(watch.next().await.unwrap());
        }
        writer.push(events, chrono::Utc::now());
        writer.flush(store).await.unwrap().unwrap();
    }
    rev
}

/// `[restore]` for `initialize` into `data` with etcd 3.5's tools, as member "default" of a
/// new cluster, validating an existing directory with `validation`.
pub fn initialize_config(
    data: &std::path::Path,
    validation: etcd_warden::config::Validation,
) -> etcd_warden::config::RestoreConfig {
    etcd_warden::config::RestoreConfig {
        data_dir: Some(data.to_path_buf()),
        name: "default".into(),
        initial_cluster: String::new(),
        initial_cluster_token: "etcd-cluster".into(),
        initial_advertise_peer_urls: "http://localhost:2380".into(),
        etcd_bin: Some(super::etcd::Release::V35.bin_dir()),
        parallel_fetch: 2,
        force: false,
        initialize: true,
        validation,
        fallback: true,
        guard: None,
        work_dir: None,
        cluster: None,
        rejoin_timeout: std::time::Duration::from_secs(60),
        peer_tls: None,
        bump_revision: 0,
        mark_compacted: false,
        read_limits: Default::default(),
    }
}

/// Restoring into `data_dir` with etcd 3.5's tools, as member "default" of a new cluster.
pub fn restore_options(data_dir: &std::path::Path) -> etcd_warden::restore::RestoreOptions {
    // A corrupt snapshot in these tests is a failure, not something to work around.
    etcd_warden::restore::RestoreOptions::scratch(
        data_dir,
        Some(super::etcd::Release::V35.bin_dir()),
        4,
    )
}

/// Starts etcd 3.5 on a restored `data_dir`, dumps it and stops it.
pub async fn dump_restored(data_dir: &std::path::Path) -> Dump {
    let etcd = super::etcd::temp_etcd(
        super::etcd::Release::V35,
        data_dir,
        "default",
        data_dir.with_extension("log"),
    )
    .await
    .unwrap();
    let mut client = Client::connect([&etcd.client_url], None).await.unwrap();
    let d = dump(&mut client).await;
    etcd.stop().await.unwrap();
    d
}
