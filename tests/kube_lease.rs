//! Leader election through a Lease (`operator::kube::lease`) against the API server double:
//! one holder at a time, a release hands over at once, a dead holder is replaced after the
//! lease duration, racing candidates yield exactly one winner, and the run loop hands over when
//! the leader stops.

use crate::support;

use std::time::Duration;

use etcd_warden::operator::kube::lease::{LeaseLock, LeaseTiming};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use support::apiserver::ApiServer;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const NAME: &str = "etcd-warden-operator";

fn timing() -> LeaseTiming {
    LeaseTiming {
        duration: Duration::from_millis(1000),
        renew_deadline: Duration::from_millis(600),
        retry: Duration::from_millis(100),
    }
}

fn lock(server: &ApiServer, id: &str) -> LeaseLock {
    let api: Api<Lease> = Api::namespaced(server.client(), "etcd");
    LeaseLock::new(api, NAME, id, timing())
}

/// The double with candidates `a` and `b`, `a` holding the Lease and `b` refused it.
async fn a_holds() -> (ApiServer, LeaseLock, LeaseLock) {
    let server = ApiServer::start().await;
    let (a, b) = (lock(&server, "a"), lock(&server, "b"));
    assert!(a.try_acquire_or_renew().await.unwrap());
    // b's clock starts when it first sees the record.
    assert!(!b.try_acquire_or_renew().await.unwrap());
    (server, a, b)
}

async fn holder(server: &ApiServer) -> Option<String> {
    let api: Api<Lease> = Api::namespaced(server.client(), "etcd");
    api.get(NAME).await.unwrap().spec.unwrap().holder_identity
}

#[tokio::test]
async fn one_holder_at_a_time_and_a_release_hands_over_at_once() {
    let (server, a, b) = a_holds().await;
    assert!(a.try_acquire_or_renew().await.unwrap(), "the holder renews");
    assert!(!b.try_acquire_or_renew().await.unwrap());
    assert_eq!(holder(&server).await.as_deref(), Some("a"));

    a.release().await.unwrap();
    assert_eq!(holder(&server).await, None);
    assert!(b.try_acquire_or_renew().await.unwrap());
    assert!(!a.try_acquire_or_renew().await.unwrap());
    let api: Api<Lease> = Api::namespaced(server.client(), "etcd");
    assert_eq!(
        api.get(NAME).await.unwrap().spec.unwrap().lease_transitions,
        Some(1)
    );
    // Releasing a Lease held by another changes nothing.
    a.release().await.unwrap();
    assert_eq!(holder(&server).await.as_deref(), Some("b"));
}

#[tokio::test]
async fn a_holder_that_stops_renewing_is_replaced_after_the_lease_duration() {
    let (server, a, b) = a_holds().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !b.try_acquire_or_renew().await.unwrap(),
        "not before the duration"
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(b.try_acquire_or_renew().await.unwrap());
    assert_eq!(holder(&server).await.as_deref(), Some("b"));
    assert!(
        !a.try_acquire_or_renew().await.unwrap(),
        "the old holder does not take it back"
    );
}

#[tokio::test]
async fn racing_candidates_yield_exactly_one_winner() {
    let server = ApiServer::start().await;
    // For a Lease nobody created yet.
    let locks: Vec<LeaseLock> = (0..4).map(|i| lock(&server, &format!("c{i}"))).collect();
    let won = futures::future::join_all(locks.iter().map(|l| l.try_acquire_or_renew())).await;
    assert_eq!(
        won.iter().filter(|w| *w.as_ref().unwrap()).count(),
        1,
        "{won:?}"
    );

    // For a released one: every candidate writes on the same version, one gets through.
    let first = locks
        .iter()
        .zip(&won)
        .find(|(_, w)| *w.as_ref().unwrap())
        .unwrap()
        .0;
    first.release().await.unwrap();
    let won = futures::future::join_all(locks.iter().map(|l| l.try_acquire_or_renew())).await;
    assert_eq!(
        won.iter().filter(|w| *w.as_ref().unwrap()).count(),
        1,
        "{won:?}"
    );
}

#[tokio::test]
async fn the_run_loop_hands_over_when_the_leader_stops() {
    let server = ApiServer::start().await;
    let a = std::sync::Arc::new(lock(&server, "a"));
    let b = std::sync::Arc::new(lock(&server, "b"));
    let (ta, mut ra) = watch::channel(false);
    let (tb, rb) = watch::channel(false);
    let (ca, cb) = (CancellationToken::new(), CancellationToken::new());
    let ja = tokio::spawn({
        let (a, ca) = (a.clone(), ca.clone());
        async move { a.run(ta, ca).await }
    });
    tokio::time::timeout(Duration::from_secs(5), ra.wait_for(|l| *l))
        .await
        .unwrap()
        .unwrap();
    let jb = tokio::spawn({
        let (b, cb) = (b.clone(), cb.clone());
        async move { b.run(tb, cb).await }
    });
    // Never both, watched for longer than a lease duration (on a loaded machine a may lose the
    // Lease to b; then a must have stopped acting first).
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!(*ra.borrow() && *rb.borrow()), "both lead");
    }
    let a_led = *ra.borrow();
    ca.cancel();
    ja.await.unwrap();
    assert!(!*ra.borrow());
    let mut rb = rb;
    // Released: b takes over within a few retry periods, not a lease duration.
    let within = if a_led { 800 } else { 3000 };
    tokio::time::timeout(Duration::from_millis(within), rb.wait_for(|l| *l))
        .await
        .expect("b leads soon after a released")
        .unwrap();
    cb.cancel();
    jb.await.unwrap();
    assert_eq!(holder(&server).await, None);
}
