//! The test DNS server behaves like a real one for hickory-resolver: changes are visible at once,
//! removal gives NXDOMAIN, and the failure modes fail the way real outages do.

use crate::support::dns;

use std::time::{Duration, Instant};

use dns::{DnsServer, Mode};
use hickory_resolver::TokioResolver;
use hickory_resolver::config::{NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::net::{DnsError, NetError};
use hickory_resolver::proto::op::ResponseCode;
use hickory_resolver::proto::rr::RData;

const NAME: &str = "owner.shoot.warden.test.";

/// A resolver that asks only `server`, caches nothing and gives up after `timeout`.
fn resolver(server: &DnsServer, timeout: Duration) -> TokioResolver {
    let mut ns = NameServerConfig::udp_and_tcp(server.addr().ip());
    for connection in &mut ns.connections {
        connection.port = server.addr().port();
    }
    let mut builder = TokioResolver::builder_with_config(
        ResolverConfig::from_name_servers(vec![ns]),
        TokioRuntimeProvider::default(),
    );
    let options = builder.options_mut();
    options.cache_size = 0;
    options.timeout = timeout;
    options.attempts = 1;
    builder.build().expect("resolver")
}

/// A server whose record says `seed-a`, and a [`resolver`] of it giving up after `timeout`.
async fn serving_seed_a(timeout: Duration) -> (DnsServer, TokioResolver) {
    let server = DnsServer::start().await;
    let resolver = resolver(&server, timeout);
    server.set_txt(NAME, &["seed-a"]).await;
    (server, resolver)
}

async fn txt(resolver: &TokioResolver) -> Result<Vec<String>, NetError> {
    let lookup = resolver.txt_lookup(NAME).await?;
    Ok(lookup
        .answers()
        .iter()
        .filter_map(|r| match &r.data {
            RData::TXT(txt) => Some(txt.to_string()),
            _ => None,
        })
        .collect())
}

#[tokio::test]
async fn a_changed_value_is_seen_within_a_second() {
    let (server, resolver) = serving_seed_a(Duration::from_secs(2)).await;
    assert_eq!(txt(&resolver).await.expect("lookup"), vec!["seed-a"]);

    server.set_txt(NAME, &["seed-b"]).await;
    let started = Instant::now();
    loop {
        let values = txt(&resolver).await.expect("lookup");
        if values == ["seed-b"] {
            break;
        }
        assert_eq!(values, vec!["seed-a"], "only the old or the new value");
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "new value not seen within 1 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn set_txt_replaces_the_record_set() {
    let server = DnsServer::start().await;
    let resolver = resolver(&server, Duration::from_secs(2));
    server.set_txt(NAME, &["one", "two"]).await;
    let mut values = txt(&resolver).await.expect("lookup");
    values.sort();
    assert_eq!(values, vec!["one", "two"]);
    server.set_txt(NAME, &["three"]).await;
    assert_eq!(txt(&resolver).await.expect("lookup"), vec!["three"]);
}

#[tokio::test]
async fn removal_gives_nxdomain() {
    let (server, resolver) = serving_seed_a(Duration::from_secs(2)).await;
    assert!(txt(&resolver).await.is_ok());
    server.remove_txt(NAME).await;
    let error = txt(&resolver)
        .await
        .expect_err("removed record must not resolve");
    assert!(error.is_nx_domain(), "expected NXDOMAIN, got {error:?}");
}

#[tokio::test]
async fn servfail_mode_answers_servfail() {
    let (server, resolver) = serving_seed_a(Duration::from_secs(2)).await;
    server.set_mode(Mode::ServFail);
    let error = txt(&resolver)
        .await
        .expect_err("SERVFAIL must fail the lookup");
    assert!(
        matches!(
            error,
            NetError::Dns(DnsError::ResponseCode(ResponseCode::ServFail))
        ),
        "expected SERVFAIL, got {error:?}"
    );
    server.set_mode(Mode::Normal);
    assert_eq!(txt(&resolver).await.expect("lookup"), vec!["seed-a"]);
}

#[tokio::test]
async fn silent_mode_times_out() {
    let (server, resolver) = serving_seed_a(Duration::from_millis(300)).await;
    server.set_mode(Mode::Silent);
    let started = Instant::now();
    let error = txt(&resolver)
        .await
        .expect_err("no answer must fail the lookup");
    assert!(
        matches!(error, NetError::Timeout),
        "expected a timeout, got {error:?}"
    );
    assert!(started.elapsed() >= Duration::from_millis(250));
}

#[tokio::test]
async fn stop_fails_lookups_and_restart_serves_the_same_zone_on_the_same_port() {
    let server = DnsServer::start().await;
    let addr = server.addr();
    let resolver = resolver(&server, Duration::from_millis(300));
    server.set_txt(NAME, &["seed-a"]).await;
    server.stop().await;
    assert!(
        txt(&resolver).await.is_err(),
        "a stopped server must not answer"
    );
    server.restart().await;
    assert_eq!(server.addr(), addr);
    assert_eq!(
        txt(&resolver).await.expect("lookup after restart"),
        vec!["seed-a"]
    );
}
