//! Owner lookups against a real DNS server (hickory-server on loopback): classification, the
//! failure threshold, and TTL handling.

use crate::support::dns;

use std::time::{Duration, Instant};

use dns::{DnsServer, Mode};
use etcd_warden::config::OwnerConfig;
use etcd_warden::owner::protocol::Verdict;
use etcd_warden::owner::resolve::{
    CheckResult, Failure, FailureCounter, OwnerLookup, OwnerResolver,
};

const NAME: &str = "owner.shoot.warden.test";

fn config(server: &DnsServer, ttl_cap: Duration) -> OwnerConfig {
    OwnerConfig {
        name: NAME.into(),
        id: "seed-a".into(),
        interval: Duration::from_secs(30),
        timeout: Duration::from_millis(500),
        nameservers: vec![server.addr()],
        failure_threshold: 3,
        ttl_cap,
        takeover_after: Duration::from_secs(300),
    }
}

fn resolver(server: &DnsServer) -> OwnerResolver {
    OwnerResolver::new(&config(server, Duration::ZERO)).expect("resolver")
}

/// A server whose record says `seed-a` (us), and a [`resolver`] of it.
async fn serving_seed_a() -> (DnsServer, OwnerResolver) {
    let server = DnsServer::start().await;
    let resolver = resolver(&server);
    server.set_txt(NAME, &["seed-a"]).await;
    (server, resolver)
}

/// A record of `ttl` seconds naming `seed-a`, checked (Owner) by a resolver capping TTLs at
/// `ttl_cap`, then changed to name `seed-b`.
async fn moved_to_seed_b(ttl_cap: Duration, ttl: u32) -> (DnsServer, OwnerResolver) {
    let server = DnsServer::start().await;
    let resolver = OwnerResolver::new(&config(&server, ttl_cap)).expect("resolver");
    server.set_txt_records(NAME, ttl, &[vec!["seed-a"]]).await;
    assert_eq!(resolver.check().await, CheckResult::Owner);
    server.set_txt_records(NAME, ttl, &[vec!["seed-b"]]).await;
    (server, resolver)
}

#[tokio::test]
async fn answers_are_classified() {
    let (server, resolver) = serving_seed_a().await;

    assert_eq!(resolver.check().await, CheckResult::Owner);

    server.set_txt(NAME, &["seed-b"]).await;
    assert_eq!(
        resolver.check().await,
        CheckResult::OtherOwner(vec!["seed-b".into()])
    );

    server
        .set_txt_records(NAME, 60, &[vec!["seed-", "a"]])
        .await;
    assert_eq!(
        resolver.check().await,
        CheckResult::Owner,
        "strings of one record concatenate"
    );

    server.set_txt(NAME, &["seed-a", "seed-b"]).await;
    assert!(
        matches!(
            resolver.check().await,
            CheckResult::Failed(Failure::Ambiguous(_))
        ),
        "our ID next to another is ambiguous"
    );

    server.set_txt(NAME, &["seed-b", "seed-c"]).await;
    assert_eq!(resolver.check().await.verdict(), Some(Verdict::NotOwner));
}

#[tokio::test]
async fn a_removed_record_is_no_record() {
    let (server, resolver) = serving_seed_a().await;
    assert_eq!(resolver.check().await, CheckResult::Owner);
    server.remove_txt(NAME).await;
    assert_eq!(resolver.check().await, CheckResult::NoRecord, "NXDOMAIN");
}

#[tokio::test]
async fn a_name_without_txt_is_no_record() {
    let server = DnsServer::start().await;
    let resolver = resolver(&server);
    server.set_a(NAME, [127, 0, 0, 1].into()).await;
    assert_eq!(
        resolver.check().await,
        CheckResult::NoRecord,
        "NOERROR, no TXT (NODATA)"
    );
}

#[tokio::test]
async fn servfail_and_silence_are_failures() {
    let (server, resolver) = serving_seed_a().await;

    server.set_mode(Mode::ServFail);
    assert!(matches!(
        resolver.check().await,
        CheckResult::Failed(Failure::ServerError(_))
    ));

    server.set_mode(Mode::Silent);
    let started = Instant::now();
    assert_eq!(
        resolver.check().await,
        CheckResult::Failed(Failure::Timeout)
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the lookup timeout bounds the check"
    );

    server.set_mode(Mode::Normal);
    assert_eq!(resolver.check().await, CheckResult::Owner);
}

#[tokio::test]
async fn a_stopped_server_is_a_failure() {
    let (server, resolver) = serving_seed_a().await;
    server.stop().await;
    let result = resolver.check().await;
    assert!(
        matches!(
            result,
            CheckResult::Failed(Failure::Network(_) | Failure::Timeout)
        ),
        "{result:?}"
    );
    server.restart().await;
    assert_eq!(resolver.check().await, CheckResult::Owner);
}

#[tokio::test]
async fn consecutive_failures_reach_unresolvable_at_the_threshold() {
    let (server, resolver) = serving_seed_a().await;
    let mut counter = FailureCounter::new(3);
    assert_eq!(
        counter.observe(&resolver.check().await),
        Some(Verdict::Owner)
    );
    server.set_mode(Mode::ServFail);
    assert_eq!(counter.observe(&resolver.check().await), None);
    assert_eq!(counter.observe(&resolver.check().await), None);
    assert_eq!(
        counter.observe(&resolver.check().await),
        Some(Verdict::Unresolvable)
    );
}

/// Polls until the check says `want`, returning how long that took.
async fn time_until(resolver: &OwnerResolver, want: &CheckResult, limit: Duration) -> Duration {
    let started = Instant::now();
    loop {
        if resolver.check().await == *want {
            return started.elapsed();
        }
        assert!(started.elapsed() < limit, "not {want:?} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_long_ttl_is_capped() {
    let (_server, resolver) = moved_to_seed_b(Duration::from_secs(1), 3600).await;
    // Cached: the answer is trusted for the (capped) TTL...
    assert_eq!(resolver.check().await, CheckResult::Owner, "answer cached");
    // ...but not for the record's hour.
    let other = CheckResult::OtherOwner(vec!["seed-b".into()]);
    time_until(&resolver, &other, Duration::from_secs(3)).await;
}

#[tokio::test]
async fn a_short_ttl_is_honoured() {
    let (_server, resolver) = moved_to_seed_b(Duration::from_secs(60), 1).await;
    assert_eq!(
        resolver.check().await,
        CheckResult::Owner,
        "answer cached for its TTL"
    );
    let other = CheckResult::OtherOwner(vec!["seed-b".into()]);
    time_until(&resolver, &other, Duration::from_secs(3)).await;
}

#[tokio::test]
async fn a_zero_cap_sees_changes_at_once() {
    let (server, resolver) = moved_to_seed_b(Duration::ZERO, 3600).await;
    assert_eq!(
        resolver.check().await,
        CheckResult::OtherOwner(vec!["seed-b".into()])
    );
    server.remove_txt(NAME).await;
    assert_eq!(resolver.check().await, CheckResult::NoRecord);
}

#[tokio::test]
async fn an_invalid_name_is_a_config_error() {
    let server = DnsServer::start().await;
    let mut config = config(&server, Duration::ZERO);
    config.name = "bad..name".into();
    assert!(OwnerResolver::new(&config).is_err());
}
