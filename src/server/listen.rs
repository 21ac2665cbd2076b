//! Serving connections so that nobody can hold the server open: a deadline for a request's
//! headers (and the TLS handshake before them), for a request's answer and for a connection with
//! nothing in flight; a cap on connections with a reserve kept for the health probes and for
//! callers inside the pod; a limit on request bodies. Plain HTTP and TLS go through the same
//! loop, and every request carries its peer address ([`ConnectInfo`]).
//!
//! At the cap a new connection takes the place of the one that has waited longest with no
//! request in flight (half-sent headers, or an idle keep-alive): holding a slot costs a client
//! nothing, so a slot that is not being used for an answer is not kept from a caller who wants
//! one. Only connections with a request in flight are never displaced; unauthenticated requests
//! are answered at once (a snapshot trigger is one at a time, 429 for the rest), so they cannot
//! fill the server either. Past `max_connections` of those, up to [`HEALTH_RESERVE`] more
//! connections are served for `/healthz` and `/livez` only (503 for anything else; callers on
//! loopback, inside the pod, get everything), one request each, headers within
//! [`RESERVE_HEADER_TIMEOUT`], displaced the same way. Past both, a new connection is closed at
//! once: the process's descriptors stay bounded, and the kernel's accept queue never fills, so
//! etcd's readiness probe is answered or refused quickly, never left hanging.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use std::collections::HashMap;
use std::sync::Mutex;
use tokio::io::{AsyncRead, AsyncWrite};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{ApiError, ClientCert};

/// Connections accepted past `max_connections`, served for the health endpoints (and callers
/// inside the pod) only.
pub const HEALTH_RESERVE: usize = 16;

/// The longest a connection in the reserve may take to send its request's headers.
pub const RESERVE_HEADER_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a connection told to close (idle, or the server stopping) may take to finish what
/// it is writing before it is dropped: a client that does not read its answer holds nothing.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// The paths that answer only once a snapshot is taken: [`Limits::snapshot_request_timeout`].
const SNAPSHOT_PATHS: [&str; 2] = ["/snapshot/full", "/snapshot/delta"];

/// The paths the reserve serves to anyone.
const HEALTH_PATHS: [&str; 2] = ["/healthz", "/livez"];

/// The server's limits (`[server]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// A new connection's TLS handshake and first request's headers, and every later request's
    /// headers, must arrive within this.
    pub header_read_timeout: Duration,
    /// A request must be answered within this (503 `timeout` otherwise).
    pub request_timeout: Duration,
    /// A snapshot trigger waits for its snapshot: answered within this.
    pub snapshot_request_timeout: Duration,
    /// A connection with no request in flight is closed after this.
    pub idle_timeout: Duration,
    /// Connections served at once, before the [`HEALTH_RESERVE`].
    pub max_connections: usize,
    /// The largest request body accepted (413 beyond).
    pub max_body_bytes: u64,
}

impl Default for Limits {
    /// The defaults of `[server]` (src/config_defaults.toml).
    fn default() -> Self {
        Limits {
            header_read_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(60),
            snapshot_request_timeout: Duration::from_secs(16 * 60),
            idle_timeout: Duration::from_secs(60),
            max_connections: 256,
            max_body_bytes: 64 * 1024,
        }
    }
}

/// A connection's byte stream, plain or TLS.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// The TLS side of a listener: the handshake, and whether mutual TLS is asked for.
#[derive(Clone)]
pub(super) struct Tls {
    pub acceptor: axum_server::tls_rustls::RustlsAcceptor,
}

/// Which service a connection gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// Everything.
    Full,
    /// Past the cap: health endpoints for callers beyond the pod, one request.
    Reserve,
}

/// Raises the soft limit on open files to the hard limit, so that the descriptors the server
/// may hold (`max_connections` plus the reserve) and the store's and etcd's connections fit
/// together; warns when even the hard limit is too low for the cap.
pub fn raise_fd_limit(limits: &Limits) {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the open-files limit");
            return;
        }
    };
    let mut now = soft;
    if soft < hard {
        match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => {
                now = hard;
                tracing::debug!(from = soft, to = hard, "raised the open-files soft limit");
            }
            Err(e) => tracing::warn!(error = %e, soft, hard, "cannot raise the open-files limit"),
        }
    }
    // The server's sockets, and room for the store's, etcd's and the files a restore opens.
    let wanted = (limits.max_connections + HEALTH_RESERVE) as u64 + 256;
    if now < wanted {
        tracing::warn!(
            limit = now,
            wanted,
            "the open-files limit is low for server.max_connections: lower it or raise the limit"
        );
    }
}

/// Serves `router` on `listener` (over `tls` when given) under `limits` until `cancel` fires,
/// then lets open requests finish for up to `drain`.
pub(super) async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    cancel: CancellationToken,
    limits: Limits,
    tls: Option<Tls>,
    drain: Duration,
) -> std::io::Result<()> {
    let registry = Arc::new(Registry::new(limits.max_connections));
    let tracker = TaskTracker::new();
    let mut last_refusal_log: Option<Instant> = None;
    loop {
        let (stream, peer) = tokio::select! {
            _ = cancel.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors (EMFILE) or a connection reset before it was accepted:
                    // retry shortly rather than spin or stop serving.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Some(seat) = registry.admit() else {
            // Closed at once (the stream is dropped here): see the module's doc.
            if last_refusal_log.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                tracing::warn!(
                    %peer,
                    max_connections = limits.max_connections,
                    "every connection has a request in flight: closing new connections"
                );
                last_refusal_log = Some(Instant::now());
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let conn = Connection {
            router: router.clone(),
            peer,
            slot: seat.slot,
            limits,
            cancel: cancel.clone(),
        };
        let tls = tls.clone();
        tracker.spawn(conn.run(stream, tls, seat));
    }
    tracker.close();
    if tokio::time::timeout(drain, tracker.wait()).await.is_err() {
        tracing::warn!("connections still open after the drain deadline; closing them");
    }
    Ok(())
}

/// One accepted connection.
struct Connection {
    router: Router,
    peer: SocketAddr,
    slot: Slot,
    limits: Limits,
    cancel: CancellationToken,
}

impl Connection {
    /// The header deadline on this connection.
    fn header_timeout(&self) -> Duration {
        match self.slot {
            Slot::Full => self.limits.header_read_timeout,
            Slot::Reserve => self.limits.header_read_timeout.min(RESERVE_HEADER_TIMEOUT),
        }
    }

    async fn run(self, stream: tokio::net::TcpStream, tls: Option<Tls>, seat: Seat) {
        let header_timeout = self.header_timeout();
        let (io, cert): (Box<dyn Io>, Option<ClientCert>) = match tls {
            None => (Box::new(stream), None),
            Some(tls) => {
                use axum_server::accept::Accept;
                // The handshake counts against the header deadline: a client that opens a
                // connection and says nothing is gone after it.
                let shake = tls.acceptor.accept(stream, ());
                let shaken = tokio::select! {
                    shaken = tokio::time::timeout(header_timeout, shake) => shaken,
                    _ = seat.evicted.cancelled() => return,
                };
                match shaken {
                    Ok(Ok((stream, ()))) => {
                        // The verifier refused a certificate it could not verify during the
                        // handshake: one that is here is verified.
                        let verified = stream
                            .get_ref()
                            .1
                            .peer_certificates()
                            .is_some_and(|c| !c.is_empty());
                        (Box::new(stream), Some(ClientCert(verified)))
                    }
                    Ok(Err(e)) => {
                        tracing::debug!(peer = %self.peer, error = %e, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(peer = %self.peer, "TLS handshake timed out");
                        return;
                    }
                }
            }
        };

        let (activity, mut idle) = watch::channel(Activity::default());
        let activity = Arc::new(activity);
        let seat = Arc::new(seat);
        let ctx = Arc::new(RequestContext {
            router: self.router.clone(),
            peer: self.peer,
            cert,
            health_only: health_only(self.slot, self.peer),
            limits: self.limits,
            activity,
            seat: seat.clone(),
        });
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let ctx = ctx.clone();
            async move { Ok::<_, Infallible>(ctx.answer(req).await) }
        });

        let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(header_timeout)
            .keep_alive(self.slot == Slot::Full);
        builder
            .http2()
            .timer(TokioTimer::new())
            .max_concurrent_streams(32)
            .max_header_list_size(64 * 1024);
        let conn = builder.serve_connection(TokioIo::new(io), service);
        tokio::pin!(conn);

        let first = header_timeout;
        let idle_after = match self.slot {
            Slot::Full => self.limits.idle_timeout,
            Slot::Reserve => header_timeout,
        };
        let closing = tokio::select! {
            done = conn.as_mut() => {
                if let Err(e) = done {
                    tracing::debug!(peer = %self.peer, error = %e, "connection ended");
                }
                return;
            }
            _ = idle_for(&mut idle, first, idle_after) => "idle",
            _ = self.cancel.cancelled() => "server stopping",
            _ = seat.evicted.cancelled() => {
                // Its slot went to a new connection: nothing was in flight, nothing to finish.
                tracing::debug!(peer = %self.peer, "connection displaced at the connection limit");
                return;
            }
        };
        tracing::debug!(peer = %self.peer, why = closing, "closing connection");
        conn.as_mut().graceful_shutdown();
        let grace = if self.cancel.is_cancelled() {
            // The server's drain deadline bounds this.
            Duration::MAX
        } else {
            CLOSE_GRACE
        };
        if tokio::time::timeout(grace, conn).await.is_err() {
            tracing::debug!(peer = %self.peer, "connection did not close in time; dropped");
        }
    }
}

/// Whether a connection may ask for the health endpoints only: in the reserve, from beyond the
/// pod (a caller inside it, on loopback, is etcd-wrapper and gets everything).
fn health_only(slot: Slot, peer: SocketAddr) -> bool {
    slot == Slot::Reserve && !peer.ip().to_canonical().is_loopback()
}

/// What a connection is doing: requests in flight, and whether it has sent one yet.
#[derive(Debug, Default, Clone, Copy)]
struct Activity {
    in_flight: usize,
    requests: u64,
}

/// Returns once the connection has had nothing in flight for `idle` (`first` until its first
/// request arrived).
async fn idle_for(rx: &mut watch::Receiver<Activity>, first: Duration, idle: Duration) {
    loop {
        let now = *rx.borrow_and_update();
        if now.in_flight == 0 {
            let wait = if now.requests == 0 { first } else { idle };
            tokio::select! {
                _ = tokio::time::sleep(wait) => return,
                changed = rx.changed() => if changed.is_err() { return },
            }
        } else if rx.changed().await.is_err() {
            return;
        }
    }
}

/// A request in flight, counted until its answer is ready.
struct InFlight(Arc<watch::Sender<Activity>>, Arc<Seat>);

impl InFlight {
    fn new(tx: &Arc<watch::Sender<Activity>>, seat: &Arc<Seat>) -> Self {
        let mut now = 0;
        tx.send_modify(|a| {
            a.in_flight += 1;
            a.requests += 1;
            now = a.in_flight;
        });
        seat.set_in_flight(now);
        InFlight(tx.clone(), seat.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut now = 0;
        self.0.send_modify(|a| {
            a.in_flight = a.in_flight.saturating_sub(1);
            now = a.in_flight;
        });
        self.1.set_in_flight(now);
    }
}

/// Every open connection, by slot, and when each last had nothing in flight: who is displaced
/// at the limit.
struct Registry {
    max_connections: usize,
    state: Mutex<Seats>,
}

#[derive(Default)]
struct Seats {
    next_id: u64,
    open: HashMap<u64, Seated>,
}

struct Seated {
    slot: Slot,
    /// Since when nothing has been in flight; `None` while a request is.
    idle_since: Option<Instant>,
    evicted: CancellationToken,
}

/// A connection's place in the [`Registry`], given back when it is dropped.
struct Seat {
    id: u64,
    slot: Slot,
    registry: Arc<Registry>,
    /// Fires when a new connection took this one's place.
    evicted: CancellationToken,
}

impl Registry {
    fn new(max_connections: usize) -> Self {
        Registry {
            max_connections,
            state: Mutex::new(Seats::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Seats> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A seat for a new connection: a free one, else the one of the connection idle longest
    /// (full slots first, then the reserve), or none when every connection is answering.
    fn admit(self: &Arc<Self>) -> Option<Seat> {
        let mut seats = self.lock();
        let count = |slot| seats.open.values().filter(|s| s.slot == slot).count();
        let slot = if count(Slot::Full) < self.max_connections {
            Slot::Full
        } else if count(Slot::Reserve) < HEALTH_RESERVE {
            Slot::Reserve
        } else {
            let longest_idle = |slot| {
                seats
                    .open
                    .iter()
                    .filter(|(_, s)| s.slot == slot)
                    .filter_map(|(id, s)| s.idle_since.map(|t| (t, *id)))
                    .min()
            };
            let (slot, (_, id)) = longest_idle(Slot::Full)
                .map(|v| (Slot::Full, v))
                .or_else(|| longest_idle(Slot::Reserve).map(|v| (Slot::Reserve, v)))?;
            if let Some(gone) = seats.open.remove(&id) {
                gone.evicted.cancel();
            }
            slot
        };
        seats.next_id += 1;
        let id = seats.next_id;
        let evicted = CancellationToken::new();
        seats.open.insert(
            id,
            Seated {
                slot,
                idle_since: Some(Instant::now()),
                evicted: evicted.clone(),
            },
        );
        Some(Seat {
            id,
            slot,
            registry: self.clone(),
            evicted,
        })
    }
}

impl Seat {
    fn set_in_flight(&self, in_flight: usize) {
        if let Some(s) = self.registry.lock().open.get_mut(&self.id) {
            s.idle_since = (in_flight == 0).then(Instant::now);
        }
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.registry.lock().open.remove(&self.id);
    }
}

/// What every request on a connection shares.
struct RequestContext {
    router: Router,
    peer: SocketAddr,
    cert: Option<ClientCert>,
    health_only: bool,
    limits: Limits,
    activity: Arc<watch::Sender<Activity>>,
    seat: Arc<Seat>,
}

impl RequestContext {
    async fn answer(&self, req: Request<Incoming>) -> Response {
        let _in_flight = InFlight::new(&self.activity, &self.seat);
        let path = req.uri().path();
        if self.health_only && !HEALTH_PATHS.contains(&path) {
            let mut resp = ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "too_many_connections",
                "the server is at server.max_connections; only /healthz and /livez are answered",
            )
            .into_response();
            resp.headers_mut().insert(
                header::CONNECTION,
                header::HeaderValue::from_static("close"),
            );
            return resp;
        }
        let timeout = if SNAPSHOT_PATHS.contains(&path) {
            self.limits.snapshot_request_timeout
        } else {
            self.limits.request_timeout
        };
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > self.limits.max_body_bytes) {
            return too_large(self.limits.max_body_bytes);
        }
        let limit = usize::try_from(self.limits.max_body_bytes).unwrap_or(usize::MAX);
        // A body sent without a length (chunked) is cut at the limit as it is read.
        let mut req = req.map(|b| Body::new(http_body_util::Limited::new(b, limit)));
        req.extensions_mut().insert(ConnectInfo(self.peer));
        if let Some(cert) = self.cert {
            req.extensions_mut().insert(cert);
        }
        let mut router = self.router.clone();
        let answered = tower::Service::call(&mut router, req);
        match tokio::time::timeout(timeout, answered).await {
            Ok(Ok(resp)) => resp,
            Ok(Err(never)) => match never {},
            Err(_) => {
                tracing::warn!(peer = %self.peer, ?timeout, "request timed out");
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "timeout",
                    "the request was not answered within server.request_timeout",
                )
                .into_response()
            }
        }
    }
}

fn too_large(max: u64) -> Response {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        format!("request bodies are limited to {max} bytes (server.max_body_bytes)"),
    )
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Test clients are all on loopback, so the reserve's restriction of callers beyond the pod
    /// is shown here on the decision alone.
    #[test]
    fn the_reserve_serves_only_the_health_endpoints_to_callers_beyond_the_pod() {
        let at = |a: &str| a.parse::<SocketAddr>().unwrap();
        assert!(health_only(Slot::Reserve, at("10.1.2.3:5000")));
        assert!(health_only(Slot::Reserve, at("[fd00::1]:5000")));
        assert!(!health_only(Slot::Reserve, at("127.0.0.1:5000")));
        assert!(!health_only(Slot::Reserve, at("[::1]:5000")));
        assert!(!health_only(Slot::Reserve, at("[::ffff:127.0.0.1]:5000")));
        assert!(!health_only(Slot::Full, at("10.1.2.3:5000")));
    }

    /// At the limit a new connection takes the place of the one idle longest, full slots
    /// first; one with a request in flight keeps its place; with every connection answering, a
    /// new one gets none.
    #[test]
    fn at_the_limit_the_longest_idle_connection_gives_its_place() {
        let r = Arc::new(Registry::new(2));
        let a = r.admit().unwrap();
        let b = r.admit().unwrap();
        assert_eq!((a.slot, b.slot), (Slot::Full, Slot::Full));
        a.set_in_flight(1);
        let reserve: Vec<Seat> = (0..HEALTH_RESERVE).map(|_| r.admit().unwrap()).collect();
        assert!(reserve.iter().all(|s| s.slot == Slot::Reserve));
        let c = r.admit().unwrap();
        assert_eq!(c.slot, Slot::Full);
        assert!(
            b.evicted.is_cancelled(),
            "the idle full connection gave its place"
        );
        assert!(!a.evicted.is_cancelled(), "the answering one kept it");
        c.set_in_flight(1);
        let d = r.admit().unwrap();
        assert_eq!(d.slot, Slot::Reserve);
        assert!(
            reserve[0].evicted.is_cancelled(),
            "then the reserve's longest idle"
        );
        for s in reserve.iter().skip(1).chain([&d]) {
            s.set_in_flight(1);
        }
        assert!(
            r.admit().is_none(),
            "every connection answering: none displaced"
        );
        drop(a);
        assert_eq!(
            r.admit().unwrap().slot,
            Slot::Full,
            "a closed connection's place is free"
        );
    }
}
