//! Test support: real servers (etcd, an S3-compatible server, DNS) started as child processes or
//! in-process on ephemeral loopback ports in temp dirs, stopped on drop.
//!
//! A missing server binary fails the test with a message saying what to install: these tests
//! never skip silently.
#![allow(dead_code)]

pub mod apiserver;
pub mod azurite;
pub mod boltdb;
pub mod cli;
pub mod deltacheck;
pub mod dns;
pub mod etcd;
pub mod faultkinds;
pub mod faultproxy;
pub mod faultrun;
pub mod finals;
pub mod forward;
pub mod handoff_judge;
pub mod history;
pub mod hosts;
pub mod invariants;
pub mod kube_world;
pub mod kvcheck;
pub mod leakprobe;
pub mod linsearch;
pub mod losing;
pub mod machine_api;
pub mod migration;
pub mod moto;
pub mod opchecks;
pub mod plants;
pub mod pod;
pub mod podns;
pub mod rbac;
pub mod recorder;
pub mod revmodel;
pub mod s3;
pub mod schedule;
pub mod service;
pub mod soak;
pub mod stored;
pub mod timeline;
pub mod tls;
pub mod traffic;
pub mod warden;
pub mod writer;

use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// A free TCP port on 127.0.0.1 (checked, then released; the caller binds it soon), for servers
/// that cannot report a port of their own: outside the ephemeral range and never handed out
/// twice in this process ([`etcd_warden::etcd::process::pick_port`]). etcd members get theirs
/// from `etcd_warden::etcd::process` too, which also starts them again when a port is lost.
pub fn free_port() -> u16 {
    // Not the kernel's port 0: two calls before either port is bound can get the same port
    // back, and outgoing connections take theirs from the ephemeral range too. (Fault seed
    // 0x6e19 gave two sidecars one port; the second failed to bind at every start.)
    etcd_warden::etcd::process::pick_port().expect("pick a free loopback port")
}

/// The first existing candidate path, or a panic telling what to install.
pub fn require_bin(what: &str, candidates: &[PathBuf], install: &str) -> PathBuf {
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!("{what} not found (looked at {candidates:?}); install it: {install}")
        })
}

/// `name` on PATH, if there.
pub fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Waits until something accepts TCP connections on `addr`.
pub fn wait_for_port(addr: SocketAddr, timeout: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// An HTTP client that gives up on a request after `timeout`.
pub fn http_client(timeout: Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(timeout)
        .build()
        .expect("HTTP client")
}

/// Whether `rx`'s value satisfies `f` within `timeout`. (The value's borrow is dropped at once:
/// holding it would block the sender.)
pub async fn seen_within<T>(
    rx: &mut tokio::sync::watch::Receiver<T>,
    timeout: Duration,
    f: impl FnMut(&T) -> bool,
) -> bool {
    tokio::time::timeout(timeout, rx.wait_for(f)).await.is_ok()
}

/// Polls `f` until it returns true or `timeout` passes; returns whether it did.
pub async fn eventually<F, Fut>(timeout: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if f().await {
            return true;
        }
        if start.elapsed() > timeout {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// A snapshot store on the local file system, in `dir` (created if missing).
pub fn file_store(dir: &std::path::Path) -> etcd_warden::store::SnapshotStore {
    std::fs::create_dir_all(dir).unwrap();
    let backend = object_store::local::LocalFileSystem::new_with_prefix(dir).unwrap();
    etcd_warden::store::SnapshotStore::new(std::sync::Arc::new(backend), "")
}

/// A single etcd 3.5, a client of it, and a snapshot store on the local file system in a
/// temporary directory (returned too: the store is there as long as it lives).
pub async fn etcd_and_file_store() -> (
    etcd::EtcdCluster,
    etcd_client::Client,
    tempfile::TempDir,
    etcd_warden::store::SnapshotStore,
) {
    let etcd = etcd::EtcdCluster::single(etcd::Release::V35).await;
    let client = etcd.client().await;
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(&dir.path().join("store"));
    (etcd, client, dir, store)
}

/// The final full snapshots in a store (none when it cannot be listed).
pub async fn finals(
    store: &etcd_warden::store::SnapshotStore,
) -> Vec<etcd_warden::store::Snapshot> {
    store
        .list()
        .await
        .unwrap_or_default()
        .into_iter()
        .filter(|s| s.kind == etcd_warden::store::Kind::Full && s.is_final)
        .collect()
}

/// The delta snapshots in a store, in its listing's order.
pub async fn deltas(
    store: &etcd_warden::store::SnapshotStore,
) -> Vec<etcd_warden::store::Snapshot> {
    let listed = store.list().await.expect("list the store");
    listed
        .into_iter()
        .filter(|s| s.kind == etcd_warden::store::Kind::Incr)
        .collect()
}

/// A snapshot actor's configuration with nothing scheduled during a test: the full snapshot's
/// cron fires only at midnight on New Year's Day and defragmentation is asked for, not
/// scheduled; deltas every `delta_period` (zero: none), holding at most `delta_memory_limit`
/// bytes; each snapshot within `timeout`.
pub fn quiet_actor_config(
    delta_period: Duration,
    delta_memory_limit: u64,
    timeout: Duration,
) -> etcd_warden::snapshot::actor::ActorConfig {
    etcd_warden::snapshot::actor::ActorConfig {
        schedule: std::str::FromStr::from_str("0 0 1 1 *").expect("cron"),
        delta_period,
        delta_memory_limit,
        gc_period: Duration::from_secs(3600),
        leader_check_interval: Duration::from_millis(100),
        timeout,
        defrag: etcd_warden::config::DefragConfig {
            timeout: Duration::from_secs(60),
            ..Default::default()
        },
    }
}
