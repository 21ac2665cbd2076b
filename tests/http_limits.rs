//! The HTTP server cannot be held open (issue 45, item 3): header, request and idle deadlines,
//! a connection cap that keeps `/healthz` answering, a body limit; over plain HTTP and TLS.
//!
//! Every client here is on loopback, so the reserve past the cap serves them everything (it
//! limits callers outside the pod to the health endpoints); that restriction is not exercised
//! over real HTTP here.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::ConnectInfo;
use axum::routing::{get, post};
use etcd_warden::server::{HEALTH_RESERVE, Limits, ServerTls, serve_with};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

fn app() -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                "slow"
            }),
        )
        .route("/echo", post(|body: axum::body::Bytes| async move { body }))
        .route(
            "/peer",
            get(|ConnectInfo(peer): ConnectInfo<SocketAddr>| async move { peer.to_string() }),
        )
}

fn limits() -> Limits {
    Limits {
        header_read_timeout: Duration::from_secs(20),
        request_timeout: Duration::from_secs(20),
        snapshot_request_timeout: Duration::from_secs(20),
        idle_timeout: Duration::from_secs(20),
        max_connections: 64,
        max_body_bytes: 1024,
    }
}

/// A server with `limits` on a loopback port; stopped when the token is dropped... by the test.
async fn start(limits: Limits, tls: Option<ServerTls>) -> (SocketAddr, CancellationToken) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cancel = CancellationToken::new();
    tokio::spawn(serve_with(listener, app(), cancel.clone(), limits, tls));
    (addr, cancel)
}

/// Whether the server closed `s` within `d` (whatever it sent before).
async fn closed_within(s: &mut TcpStream, d: Duration) -> bool {
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + d;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// A raw HTTP/1.1 request on a new connection: the status line, within `d`.
async fn status_line(addr: SocketAddr, request: &str, d: Duration) -> Result<String, String> {
    tokio::time::timeout(d, async {
        let mut s = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        s.write_all(request.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !got.windows(2).any(|w| w == b"\r\n") {
            let n = s.read(&mut buf).await.map_err(|e| e.to_string())?;
            if n == 0 {
                return Err(format!("closed after {:?}", String::from_utf8_lossy(&got)));
            }
            got.extend_from_slice(&buf[..n]);
        }
        let text = String::from_utf8_lossy(&got).into_owned();
        Ok(text.lines().next().unwrap_or_default().to_string())
    })
    .await
    .map_err(|_| format!("no answer within {d:?}"))?
}

const HEALTHZ: &str = "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";

#[tokio::test]
async fn a_client_sending_a_header_line_a_second_is_closed_at_the_header_deadline() {
    let (addr, cancel) = start(
        Limits {
            header_read_timeout: Duration::from_secs(1),
            ..limits()
        },
        None,
    )
    .await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let began = Instant::now();
    s.write_all(b"GET /healthz HTTP/1.1\r\n").await.unwrap();
    // One header line every 250 ms, never the blank line that ends them, for up to 5 s.
    let mut closed = false;
    for i in 0..20 {
        let _ = s.write_all(format!("X-Slow-{i}: 1\r\n").as_bytes()).await;
        if closed_within(&mut s, Duration::from_millis(250)).await {
            closed = true;
            break;
        }
    }
    let held = began.elapsed();
    assert!(closed, "the slow client still connected after {held:?}");
    assert!(
        held < Duration::from_millis(2500),
        "closed only after {held:?}"
    );
    cancel.cancel();
}

#[tokio::test]
async fn healthz_answers_while_more_connections_than_the_cap_are_held_half_sent() {
    let cap = 4;
    let (addr, cancel) = start(
        Limits {
            max_connections: cap,
            ..limits()
        },
        None,
    )
    .await;
    // Far more half-sent requests than the cap and the reserve together: headers never ended,
    // and the header deadline (20 s) far away.
    let mut held = Vec::new();
    for _ in 0..(cap + HEALTH_RESERVE + 40) {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        held.push(s);
    }
    // The probe is answered, at once, every time.
    for _ in 0..10 {
        let began = Instant::now();
        let line = status_line(addr, HEALTHZ, Duration::from_secs(2))
            .await
            .unwrap();
        assert!(line.starts_with("HTTP/1.1 200"), "{line}");
        assert!(
            began.elapsed() < Duration::from_secs(1),
            "{:?}",
            began.elapsed()
        );
    }
    // The server holds no more than the cap and the reserve: the others were closed.
    let mut open = 0;
    for s in &mut held {
        if !closed_within(s, Duration::from_millis(20)).await {
            open += 1;
        }
    }
    assert!(
        open <= cap + HEALTH_RESERVE,
        "{open} of {} half-sent connections still open",
        held.len()
    );
    cancel.cancel();
}

#[tokio::test]
async fn a_connection_with_a_request_in_flight_is_never_displaced() {
    let (addr, cancel) = start(
        Limits {
            max_connections: 1,
            ..limits()
        },
        None,
    )
    .await;
    let slow = tokio::spawn(status_line(
        addr,
        "GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    ));
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The one full slot is answering: the probe gets a place in the reserve, and every
    // connection past that displaces another in the reserve, never the answering one.
    for _ in 0..(HEALTH_RESERVE + 4) {
        let line = status_line(addr, HEALTHZ, Duration::from_secs(2))
            .await
            .unwrap();
        assert!(line.starts_with("HTTP/1.1 200"), "{line}");
    }
    let line = slow.await.unwrap().unwrap();
    assert!(line.starts_with("HTTP/1.1 200"), "{line}");
    cancel.cancel();
}

#[tokio::test]
async fn a_request_not_answered_in_time_is_503_and_an_idle_connection_is_closed() {
    let (addr, cancel) = start(
        Limits {
            request_timeout: Duration::from_millis(300),
            idle_timeout: Duration::from_secs(1),
            ..limits()
        },
        None,
    )
    .await;
    let began = Instant::now();
    let line = status_line(
        addr,
        "GET /slow HTTP/1.1\r\nHost: x\r\n\r\n",
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert!(line.starts_with("HTTP/1.1 503"), "{line}");
    assert!(
        began.elapsed() < Duration::from_secs(1),
        "{:?}",
        began.elapsed()
    );

    // A kept-alive connection that asks nothing more is closed after the idle timeout.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = s.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    let began = Instant::now();
    assert!(
        closed_within(&mut s, Duration::from_secs(4)).await,
        "an idle connection still open after 4 s"
    );
    assert!(
        began.elapsed() >= Duration::from_millis(800),
        "{:?}",
        began.elapsed()
    );
    cancel.cancel();
}

#[tokio::test]
async fn bodies_past_the_limit_are_refused() {
    let (addr, cancel) = start(limits(), None).await;
    let http = reqwest::Client::new();
    let url = format!("http://{addr}/echo");
    let small = http.post(&url).body(vec![b'a'; 100]).send().await.unwrap();
    assert_eq!(small.status(), 200);
    // Declared too large: refused before it is read.
    let big = http.post(&url).body(vec![b'a'; 4096]).send().await.unwrap();
    assert_eq!(big.status(), 413);
    // Chunked, no length: cut at the limit as it is read.
    let chunks = futures::stream::iter(
        (0..8).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b'a'; 512]))),
    );
    let streamed = http
        .post(&url)
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await
        .unwrap();
    assert_eq!(streamed.status(), 413);
    cancel.cancel();
}

#[tokio::test]
async fn over_tls_a_silent_client_is_closed_at_the_header_deadline_and_requests_carry_the_peer() {
    let certs = tempfile::tempdir().unwrap();
    crate::support::tls::make_certs(certs.path());
    let tls = ServerTls {
        cert: certs.path().join("server.pem"),
        key: certs.path().join("server.key"),
        client_ca: None,
    };
    let (addr, cancel) = start(
        Limits {
            header_read_timeout: Duration::from_secs(1),
            ..limits()
        },
        Some(tls),
    )
    .await;
    // Connects and never starts the handshake.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let began = Instant::now();
    assert!(
        closed_within(&mut s, Duration::from_secs(5)).await,
        "a silent TLS client still connected after 5 s"
    );
    assert!(
        began.elapsed() < Duration::from_millis(2500),
        "closed only after {:?}",
        began.elapsed()
    );

    let ca = reqwest::Certificate::from_pem(&std::fs::read(certs.path().join("ca.pem")).unwrap())
        .unwrap();
    let http = reqwest::Client::builder()
        .add_root_certificate(ca)
        .build()
        .unwrap();
    let peer = http
        .get(format!("https://{addr}/peer"))
        .send()
        .await
        .unwrap();
    assert_eq!(peer.status(), 200);
    let peer: SocketAddr = peer.text().await.unwrap().parse().unwrap();
    assert!(peer.ip().is_loopback(), "{peer}");
    cancel.cancel();
}

/// etcd-druid's initialization endpoints answer only callers inside the pod (issue 45, item
/// 6): over real HTTP a loopback caller is served, without a token configured. That a caller
/// beyond the pod is refused is shown in the druid module's unit tests (a test can only connect
/// from loopback).
#[tokio::test]
async fn the_druid_endpoints_answer_a_caller_on_loopback() {
    use etcd_warden::config::{Config, DruidConfig, Sources};
    let sources = Sources {
        file: None,
        env: &std::collections::HashMap::<String, String>::new(),
        overrides: vec![],
    };
    let (config, _) = Config::load(&sources).unwrap();
    let druid = etcd_warden::druid::Druid::new(
        DruidConfig::without_leases("/nonexistent/etcd.conf.yaml", "etcd-main-0"),
        config.restore,
        etcd_warden::store::SnapshotStore::new(
            std::sync::Arc::new(object_store::memory::InMemory::new()),
            "",
        ),
        None,
        Default::default(),
        CancellationToken::new(),
    );
    let router = etcd_warden::druid::routes(druid, etcd_warden::server::PodCallers { token: None });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cancel = CancellationToken::new();
    tokio::spawn(serve_with(listener, router, cancel.clone(), limits(), None));
    let resp = reqwest::get(format!("http://{addr}/initialization/status"))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "New");
    cancel.cancel();
}

/// The store as `/snapshot/latest` lists it, counting listings; they hang until `open` is true.
struct CountingStore {
    listings: std::sync::atomic::AtomicUsize,
    open: tokio::sync::watch::Sender<bool>,
}

#[async_trait::async_trait]
impl etcd_warden::server::SnapshotApi for CountingStore {
    async fn latest(&self) -> Result<etcd_warden::server::Latest, etcd_warden::server::ApiError> {
        use etcd_warden::store::{Codec, Kind, Snapshot};
        self.listings
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let _ = self.open.subscribe().wait_for(|open| *open).await;
        let at = chrono::DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        // A store of 10 k objects: a few MB of JSON.
        Ok(etcd_warden::server::Latest {
            full_snapshot: Some(Snapshot::new("", Kind::Full, 0, 1, at, Codec::Gzip, false)),
            delta_snapshots: (2..10_000)
                .map(|r| Snapshot::new("", Kind::Incr, r, r, at, Codec::Gzip, false))
                .collect(),
        })
    }
    async fn take(
        &self,
        _: etcd_warden::server::SnapshotRequest,
    ) -> Result<Option<etcd_warden::store::Snapshot>, etcd_warden::server::ApiError> {
        Ok(None)
    }
    fn version(&self) -> etcd_warden::server::StoreVersion {
        Default::default()
    }
}

struct NoStatus;
impl etcd_warden::server::StatusSource for NoStatus {
    fn status(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
}

/// One HTTP/1.1 answer on a kept-alive connection: its status line and body.
async fn answer(s: &mut TcpStream) -> (String, Vec<u8>) {
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    let head_end = loop {
        if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed after {:?}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&got[..head_end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .expect("a content-length")
        .trim()
        .parse()
        .unwrap();
    while got.len() < head_end + length {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed in the body");
        got.extend_from_slice(&buf[..n]);
    }
    let status = head.lines().next().unwrap_or_default().to_string();
    (status, got[head_end..head_end + length].to_vec())
}

/// Issue 54, item 6: kept-alive callers asking `/snapshot/latest` at once made one LIST of the
/// whole store each (3.5 GB, `/healthz` at 10 s). Now one listing serves them all, later requests
/// none, and `/healthz` answers while that listing hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_latest_requests_lists_the_store_once_and_healthz_answers_meanwhile() {
    use etcd_warden::server::{LatestCache, Readiness, ServerState, router};
    use std::sync::Arc;
    let store = Arc::new(CountingStore {
        listings: Default::default(),
        open: tokio::sync::watch::channel(false).0,
    });
    let (_ready, readiness) = tokio::sync::watch::channel(Readiness {
        ready: true,
        state: "Active".into(),
        reason: "test".into(),
    });
    let (_live, liveness) = tokio::sync::watch::channel(None);
    let state = ServerState {
        readiness,
        snapshots: store.clone(),
        latest: LatestCache::new(Duration::from_secs(3600)),
        status: Arc::new(NoStatus),
        registry: Arc::new(prometheus_client::registry::Registry::default()),
        drill: None,
        token: None,
        unauthenticated_snapshots: false,
        client_certs: false,
        ebr_answers: false,
        liveness,
        mutating: Arc::new(tokio::sync::Semaphore::new(1)),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cancel = CancellationToken::new();
    tokio::spawn(serve_with(
        listener,
        router(state),
        cancel.clone(),
        limits(),
        None,
    ));

    const LATEST: &[u8] = b"GET /snapshot/latest HTTP/1.1\r\nHost: x\r\n\r\n";
    let mut callers = Vec::new();
    for _ in 0..limits().max_connections - 8 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(LATEST).await.unwrap();
        callers.push(s);
    }
    let listings = || store.listings.load(std::sync::atomic::Ordering::SeqCst);
    tokio::time::timeout(Duration::from_secs(20), async {
        while listings() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("a listing starts");
    // The listing hangs; the probe does not wait for it.
    for _ in 0..10 {
        let line = status_line(addr, HEALTHZ, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(line.starts_with("HTTP/1.1 200"), "{line}");
    }
    store.open.send_replace(true);
    let mut first = None;
    for round in 0..3 {
        for s in &mut callers {
            let (status, body) = answer(s).await;
            assert!(
                status.starts_with("http/1.1 200"),
                "round {round}: {status}"
            );
            let first = first.get_or_insert_with(|| body.clone());
            assert!(*first == body, "every caller gets the same answer");
            if round < 2 {
                s.write_all(LATEST).await.unwrap();
            }
        }
    }
    assert_eq!(listings(), 1, "listings for {} requests", 3 * callers.len());
    cancel.cancel();
}
