//! The HTTP API: readiness, snapshots, metrics, status.
//!
//! `GET /healthz` is etcd's readiness (200 only when the sidecar says etcd may serve), `GET /livez`
//! the sidecar's own liveness (503 once a critical task ended), `GET /status` what the sidecar is
//! doing, `GET /snapshot/latest` the latest full snapshot and its deltas,
//! `POST /snapshot/full[?final=true]` and `POST /snapshot/delta` take one now, and `GET /metrics`
//! the Prometheus text. The snapshot triggers also answer `GET`, as etcd-backup-restore's do
//! (etcd-druid's compaction and Gardener's final-snapshot call use `GET` and expect 200): the
//! same handler and rules, only the success status differs (200 with the snapshot JSON, `null`
//! for a delta with nothing to write, where `POST` answers 201 or 204; under etcd-druid, `[druid]`,
//! `POST` answers as `GET`). The mutating endpoints take a bearer token when one is configured
//! (configuration requires one whenever the server listens beyond loopback) and one request at a
//! time (429 while one is in flight), so nobody can queue snapshots in front of a kill; what the
//! ownership protocol forbids is refused with 409. The token is checked before the query is read,
//! so a caller without it learns nothing from a 400. Every error is JSON
//! `{"code": …, "message": …}`, axum's own answers included (404, 405, a query that does not
//! parse); internal details go to the log, not the client.

use std::sync::Arc;

use async_trait::async_trait;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::Secret;
use crate::store::layout::Snapshot;

mod latest;
mod listen;
pub use latest::{LatestCache, MAX_AGE_WITHOUT_DELTAS, StoreVersion, max_age};
pub use listen::{HEALTH_RESERVE, Limits, RESERVE_HEADER_TIMEOUT, raise_fd_limit};

/// What `/healthz` answers: whether etcd may serve clients, and why (not).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Readiness {
    /// 200 when true, 503 otherwise.
    pub ready: bool,
    /// The sidecar's state (`Starting`, `Active`, `Suspended`, `Deactivated`, or [`FAILED`]).
    pub state: String,
    /// Why it is (not) ready, for whoever reads the probe's body.
    pub reason: String,
}

impl Readiness {
    /// Not ready yet: nothing has been decided.
    pub fn starting() -> Self {
        Self {
            ready: false,
            state: "Starting".into(),
            reason: "no verdict yet".into(),
        }
    }
}

/// The readiness state a sidecar ends in once a critical task ended: final, see [`set_readiness`].
pub const FAILED: &str = "Failed";

/// Publishes readiness (the one place it is set): `state` is shown capitalised (`Active`), and a
/// change is logged.
///
/// [`FAILED`] is sticky and never ready: the sidecar is failing closed and stops its tasks only
/// after publishing it, so a task still running (the watchdog finishing a check) must not turn
/// `/healthz` back to 200 in between.
pub fn set_readiness(tx: &watch::Sender<Readiness>, ready: bool, state: &str, reason: &str) {
    let mut chars = state.chars();
    let state: String = chars
        .next()
        .map(|c| c.to_uppercase().chain(chars).collect())
        .unwrap_or_default();
    let failing = state == FAILED;
    let r = Readiness {
        ready: ready && !failing,
        state,
        reason: reason.to_string(),
    };
    tx.send_if_modified(|cur| {
        if cur.state == FAILED && !failing {
            tracing::debug!(ready, state = %r.state, reason, "readiness is Failed for good; not changed");
            return false;
        }
        let changed = *cur != r;
        if changed {
            if cur.ready != r.ready || cur.state != r.state {
                tracing::info!(ready = r.ready, state = %r.state, reason, "readiness changed");
            }
            *cur = r.clone();
        }
        changed
    });
}

/// What `/livez` answers: `None` while every critical task runs, else why not.
pub type Liveness = Option<String>;

/// The latest full snapshot and the deltas after it, as `GET /snapshot/latest` shows them.
pub type Latest = crate::store::Chain;

/// What a snapshot request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotRequest {
    /// `POST /snapshot/full`; `is_final` asks for the hand-off's final (`?final=true`).
    Full {
        is_final: bool,
    },
    /// `POST /snapshot/full?final=true` under `[druid]`: etcd-druid's requested final, a full
    /// snapshot taken now and named final as etcd-backup-restore names it, which no reader
    /// takes for a hand-off's final (once deactivated, the hand-off's own final answers it).
    RequestedFinal,
    Delta,
}

/// The snapshot side of the API (the snapshot actor in production, a fake in tests).
#[async_trait]
pub trait SnapshotApi: Send + Sync {
    /// The latest full snapshot and its later deltas, from the store (a listing: the server
    /// calls it through [`LatestCache`]).
    async fn latest(&self) -> Result<Latest, ApiError>;
    /// What this sidecar knows of changes to the store, from memory only: a cached
    /// [`latest`](Self::latest) answer is served only while this is unchanged.
    fn version(&self) -> StoreVersion;
    /// Takes a snapshot now; `None` for a delta when there was nothing to write.
    async fn take(&self, what: SnapshotRequest) -> Result<Option<Snapshot>, ApiError>;
}

/// What `/status` shows: assembled on request from the components.
pub trait StatusSource: Send + Sync {
    /// A JSON object describing the component.
    fn status(&self) -> serde_json::Value;
}

/// Everything the handlers need.
#[derive(Clone)]
pub struct ServerState {
    pub readiness: watch::Receiver<Readiness>,
    pub snapshots: Arc<dyn SnapshotApi>,
    /// `/snapshot/latest`'s answers, one listing at a time.
    pub latest: Arc<LatestCache>,
    pub status: Arc<dyn StatusSource>,
    pub registry: Arc<Registry>,
    /// The store whose restore drill record the metrics show, refreshed on a scrape.
    pub drill: Option<(
        crate::store::SnapshotStore,
        crate::restore::drill::DrillMetrics,
    )>,
    /// Bearer token for the mutating endpoints.
    pub token: Option<Secret>,
    /// The snapshot triggers (not a final) need no token (`server.unauthenticated_snapshots`).
    pub unauthenticated_snapshots: bool,
    /// Mutual TLS is configured: a caller with a verified client certificate ([`ClientCert`])
    /// is authenticated, and without the token one without is not.
    pub client_certs: bool,
    /// Snapshot triggers answer 200 with the snapshot (or `null`) whatever the method, as
    /// etcd-backup-restore's do (`[druid]`).
    pub ebr_answers: bool,
    /// The sidecar's liveness.
    pub liveness: watch::Receiver<Liveness>,
    /// One mutating request at a time.
    pub mutating: Arc<tokio::sync::Semaphore>,
}

/// An error answer: status, a stable code, and a message fit for clients.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl ApiError {
    /// A new error answer.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    /// The store or etcd could not be reached: the caller may retry.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "code": self.code, "message": self.message });
        (self.status, Json(body)).into_response()
    }
}

/// The API's routes over `state`.
pub fn router(state: ServerState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/livez", get(livez))
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .route("/snapshot/latest", get(latest))
        .route("/snapshot/full", post(take_full).get(take_full))
        .route("/snapshot/delta", post(take_delta).get(take_delta))
        .fallback(|| async {
            ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint")
        })
        // axum keeps its `Allow` header on this answer.
        .method_not_allowed_fallback(|method: Method| async move {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                format!("{method} is not allowed here; see the Allow header"),
            )
        })
        .with_state(state)
}

async fn healthz(State(s): State<ServerState>) -> Response {
    // Memory only (the readiness channel): never the store or a listing, so a flood of
    // `/snapshot/latest` or a hanging store cannot make the probe late.
    let r = s.readiness.borrow().clone();
    if r.ready {
        return (StatusCode::OK, Json(r)).into_response();
    }
    // An error answer like every other: the readiness fields, and a code.
    let mut body = serde_json::to_value(&r).unwrap_or_default();
    if let Some(obj) = body.as_object_mut() {
        obj.insert("code".into(), "not_ready".into());
    }
    (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
}

async fn livez(State(s): State<ServerState>) -> Response {
    match s.liveness.borrow().clone() {
        None => (StatusCode::OK, "ok").into_response(),
        Some(reason) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "not_live", reason).into_response()
        }
    }
}

async fn status(State(s): State<ServerState>) -> Json<serde_json::Value> {
    let mut v = s.status.status();
    if let Some(obj) = v.as_object_mut() {
        obj.insert(
            "readiness".into(),
            serde_json::to_value(&*s.readiness.borrow()).unwrap_or_default(),
        );
    }
    Json(v)
}

async fn metrics(State(s): State<ServerState>) -> Response {
    if let Some((store, drill)) = &s.drill {
        drill.refresh(store).await;
    }
    let mut text = String::new();
    match prometheus_client::encoding::text::encode(&mut text, &s.registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => {
            tracing::error!(error = %e, "encoding metrics failed");
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "encoding metrics failed",
            )
            .into_response()
        }
    }
}

async fn latest(State(s): State<ServerState>) -> Response {
    match s.latest.get(&s.snapshots).await {
        // The body is shared between every caller of one listing, not encoded per request.
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => e.into_response(),
    }
}

#[derive(Deserialize)]
struct FullQuery {
    #[serde(default)]
    r#final: bool,
}

async fn take_full(
    State(s): State<ServerState>,
    method: Method,
    headers: HeaderMap,
    cert: Option<axum::Extension<ClientCert>>,
    query: Result<Query<FullQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let cert = cert.is_some_and(|c| c.0.0);
    // Who asks first, then what: an unauthenticated caller learns nothing about the query. Open
    // triggers are open for regular snapshots only, so the query is read first then.
    if !s.unauthenticated_snapshots {
        authorize(&s, &headers, cert)?;
    }
    let Query(q) = query.map_err(bad_query)?;
    // Under etcd-druid a final is druid's requested final, no hand-off's: it needs what any
    // trigger needs (druid calls without a token, from where the NetworkPolicy admits).
    if s.unauthenticated_snapshots && q.r#final && !s.ebr_answers {
        authorize_final(&s, &headers, cert)?;
    }
    let _one = one_at_a_time(&s)?;
    let what = match (q.r#final, s.ebr_answers) {
        (true, true) => SnapshotRequest::RequestedFinal,
        (is_final, _) => SnapshotRequest::Full { is_final },
    };
    let taken = s.snapshots.take(what).await?;
    match taken {
        // The hand-off's final is the watchdog's: this request found it, it created nothing.
        Some(snap) if q.r#final => Ok((StatusCode::OK, Json(ebr_snapshot(snap))).into_response()),
        other => snapshot_answer(&s, &method, other),
    }
}

async fn take_delta(
    State(s): State<ServerState>,
    method: Method,
    headers: HeaderMap,
    cert: Option<axum::Extension<ClientCert>>,
) -> Result<Response, ApiError> {
    if !s.unauthenticated_snapshots {
        authorize(&s, &headers, cert.is_some_and(|c| c.0.0))?;
    }
    let _one = one_at_a_time(&s)?;
    let taken = s.snapshots.take(SnapshotRequest::Delta).await?;
    snapshot_answer(&s, &method, taken)
}

/// A query string the handler cannot read: 400 with axum's reason (it names the parameter).
fn bad_query(rejection: QueryRejection) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "bad_query", rejection.body_text())
}

/// The permit of the one mutating request in flight, or 429.
fn one_at_a_time(s: &ServerState) -> Result<tokio::sync::OwnedSemaphorePermit, ApiError> {
    s.mutating.clone().try_acquire_owned().map_err(|_| {
        ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "busy",
            "another snapshot request is in flight; retry when it has finished",
        )
    })
}

/// The success answer: `POST` says what it created (201, or 204 for nothing); `GET` answers as
/// etcd-backup-restore does, 200 with the snapshot JSON (`null` when there was nothing to write),
/// because its callers accept nothing else.
/// Under etcd-druid ([`ServerState::ebr_answers`]) `POST` answers as `GET` does: druid's
/// on-demand snapshot task posts and accepts nothing but 200.
fn snapshot_answer(
    s: &ServerState,
    method: &Method,
    taken: Option<Snapshot>,
) -> Result<Response, ApiError> {
    Ok(match (taken, *method == Method::GET || s.ebr_answers) {
        (taken, true) => (StatusCode::OK, Json(taken.map(ebr_snapshot))).into_response(),
        (Some(snap), false) => (StatusCode::CREATED, Json(ebr_snapshot(snap))).into_response(),
        (None, false) => StatusCode::NO_CONTENT.into_response(),
    })
}

/// With open triggers (`server.unauthenticated_snapshots`), a final snapshot still needs an
/// authenticated caller (the token, or a client certificate): a final tells a copy Job the
/// source is done, so an anonymous caller must not be able to claim it. With neither
/// configured, nobody may ask for one over HTTP.
fn authorize_final(s: &ServerState, headers: &HeaderMap, cert: bool) -> Result<(), ApiError> {
    if s.token.is_none() && !s.client_certs {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "final_needs_token",
            "a final snapshot needs an authenticated caller: set server.token or \
             server.tls_client_ca_file (the snapshot triggers are open to anyone who reaches \
             the port, final snapshots are not)",
        ));
    }
    authorize(s, headers, cert)
}

/// A snapshot as etcd-backup-restore's `Snapshot` JSON has it: etcd-warden's fields (the same
/// names) and the ones it has no use for at their zero values (`snapDir` empty in the v2 layout,
/// no chunks, no object-lock version or expiry; `immutabilityExpriyTime` is spelt as on the
/// wire).
fn ebr_snapshot(snap: Snapshot) -> serde_json::Value {
    let mut v = serde_json::to_value(&snap).unwrap_or_default();
    if let Some(o) = v.as_object_mut() {
        o.insert("snapDir".into(), "".into());
        o.insert("isChunk".into(), false.into());
        o.insert("versionID".into(), serde_json::Value::Null);
        o.insert(
            "immutabilityExpriyTime".into(),
            "0001-01-01T00:00:00Z".into(),
        );
    }
    v
}

/// Checks the caller of a mutating request: a verified client certificate (`cert`) will do;
/// else the bearer token when one is configured; with neither a token nor mutual TLS
/// configured, the server listens on loopback only and anyone there may ask.
fn authorize(s: &ServerState, headers: &HeaderMap, cert: bool) -> Result<(), ApiError> {
    if cert {
        return Ok(());
    }
    let Some(secret) = &s.token else {
        if s.client_certs {
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "a client certificate issued by server.tls_client_ca_file is required",
            ));
        }
        return Ok(());
    };
    check_token(secret, headers)
}

/// The bearer token in `headers` against `secret`: 401 unless it matches.
fn check_token(secret: &Secret, headers: &HeaderMap) -> Result<(), ApiError> {
    let expected = secret.read().map_err(|e| {
        tracing::error!(error = %e, "cannot read server.token_file");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "token unavailable",
        )
    })?;
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if constant_time_eq(given.as_bytes(), expected.as_bytes()) && !expected.is_empty() {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a valid bearer token is required",
        ))
    }
}

/// Who may call the endpoints only the pod's own containers need (etcd-wrapper's
/// `/initialization/*` and `/config` under etcd-druid): see [`pod_only`].
#[derive(Clone)]
pub struct PodCallers {
    /// `server.token`: a caller beyond the pod with it is let in.
    pub token: Option<Secret>,
}

/// Middleware letting in a caller inside the pod (its address is loopback: the containers of a
/// pod share its network namespace), one with a verified client certificate, or one with the
/// bearer token; anyone else is refused before the handler runs (so nobody else can consume
/// `/initialization/status`'s one-shot answer). A request without a peer address is refused.
pub async fn pod_only(
    State(callers): State<PodCallers>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let peer = req
        .extensions()
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0);
    let cert = req.extensions().get::<ClientCert>().is_some_and(|c| c.0);
    match check_pod_caller(callers.token.as_ref(), peer, req.headers(), cert) {
        Ok(()) => next.run(req).await,
        Err(e) => {
            tracing::warn!(peer = ?peer, path = %req.uri().path(), "refused a caller outside the pod");
            e.into_response()
        }
    }
}

/// [`pod_only`]'s decision.
pub fn check_pod_caller(
    token: Option<&Secret>,
    peer: Option<std::net::SocketAddr>,
    headers: &HeaderMap,
    cert: bool,
) -> Result<(), ApiError> {
    if cert || peer.is_some_and(|p| p.ip().to_canonical().is_loopback()) {
        return Ok(());
    }
    match token {
        Some(secret) => check_token(secret, headers),
        None => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "pod_only",
            "only callers inside the pod (loopback), with server.token or a client certificate \
             may call this endpoint",
        )),
    }
}

/// Compares without an early exit, so the time taken says nothing about the token.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, x) in a.iter().enumerate() {
        diff |= usize::from(x ^ b.get(i).copied().unwrap_or(0));
    }
    diff == 0
}

/// How often the TLS certificate files are checked for rotation.
const TLS_RELOAD_CHECK: std::time::Duration = std::time::Duration::from_secs(10);

/// How long open requests may take to finish after `cancel` fires.
const DRAIN: std::time::Duration = std::time::Duration::from_secs(10);

fn modified(p: &std::path::Path) -> Option<std::time::SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

/// The server's TLS material, as PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTls {
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
    /// Ask callers for a client certificate and verify it against these CAs (mutual TLS); a
    /// caller with a verified one is authenticated for the mutating endpoints
    /// ([`ClientCert`]). A caller without one is still served (etcd-wrapper presents none).
    pub client_ca: Option<std::path::PathBuf>,
}

impl ServerTls {
    fn files(&self) -> Vec<&std::path::Path> {
        let mut f = vec![self.cert.as_path(), self.key.as_path()];
        f.extend(self.client_ca.as_deref());
        f
    }

    /// rustls's configuration from the files as they are now.
    fn rustls(&self) -> std::io::Result<Arc<rustls::ServerConfig>> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let io = |what: &std::path::Path, e: &dyn std::fmt::Display| {
            std::io::Error::other(format!("{}: {e}", what.display()))
        };
        let certs = |path: &std::path::Path| -> std::io::Result<Vec<CertificateDer<'static>>> {
            CertificateDer::pem_file_iter(path)
                .map_err(|e| io(path, &e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| io(path, &e))
        };
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| io(&self.cert, &e))?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in certs(ca)? {
                    roots.add(c).map_err(|e| io(ca, &e))?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .allow_unauthenticated()
                .build()
                .map_err(|e| io(ca, &e))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let key = PrivateKeyDer::from_pem_file(&self.key).map_err(|e| io(&self.key, &e))?;
        let mut config = builder
            .with_single_cert(certs(&self.cert)?, key)
            .map_err(|e| io(&self.cert, &e))?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// Whether this connection's caller presented a client certificate the configured CA verified
/// (a request extension on connections served with TLS; see [`ServerTls::client_ca`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientCert(pub bool);

/// Serves `router` on `listener` under `limits` (over HTTPS with `tls`'s files when given) until
/// `cancel` fires, then drains open requests. Every request carries its peer's address
/// (`ConnectInfo<SocketAddr>`) and, over TLS, [`ClientCert`].
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    router: Router,
    cancel: CancellationToken,
    limits: Limits,
    tls: Option<ServerTls>,
) -> std::io::Result<()> {
    match tls {
        None => listen::serve(listener, router, cancel, limits, None, DRAIN).await,
        Some(tls) => {
            serve_tls_limited(listener, router, cancel, tls, TLS_RELOAD_CHECK, limits).await
        }
    }
}

/// Serves `router` over HTTPS with `tls`'s files until `cancel` fires, under the default
/// [`Limits`]; the files are loaded again when they change (certificate rotation without a
/// restart).
pub async fn serve_tls(
    listener: tokio::net::TcpListener,
    router: Router,
    cancel: CancellationToken,
    tls: ServerTls,
) -> std::io::Result<()> {
    serve_tls_limited(
        listener,
        router,
        cancel,
        tls,
        TLS_RELOAD_CHECK,
        Limits::default(),
    )
    .await
}

/// [`serve_tls`], looking at the files every `check`.
pub async fn serve_tls_checking(
    listener: tokio::net::TcpListener,
    router: Router,
    cancel: CancellationToken,
    tls: ServerTls,
    check: std::time::Duration,
) -> std::io::Result<()> {
    serve_tls_limited(listener, router, cancel, tls, check, Limits::default()).await
}

async fn serve_tls_limited(
    listener: tokio::net::TcpListener,
    router: Router,
    cancel: CancellationToken,
    tls: ServerTls,
    check: std::time::Duration,
    limits: Limits,
) -> std::io::Result<()> {
    let config = axum_server::tls_rustls::RustlsConfig::from_config(tls.rustls()?);
    let reload = {
        let (config, cancel, tls) = (config.clone(), cancel.clone(), tls.clone());
        tokio::spawn(async move {
            let stamp = |tls: &ServerTls| tls.files().into_iter().map(modified).collect::<Vec<_>>();
            let mut seen = stamp(&tls);
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(check) => {}
                }
                let now = stamp(&tls);
                if now != seen {
                    match tls.rustls() {
                        Ok(c) => {
                            config.reload_from_config(c);
                            tracing::info!(cert = %tls.cert.display(), "TLS certificate reloaded");
                            seen = now;
                        }
                        // A half-written pair: keep serving the old one, try again next time.
                        Err(e) => tracing::warn!(error = %e, "TLS certificate reload failed"),
                    }
                }
            }
        })
    };
    // The connection loop bounds the handshake by the header deadline itself.
    let acceptor = axum_server::tls_rustls::RustlsAcceptor::new(config)
        .handshake_timeout(std::time::Duration::from_secs(24 * 3600));
    let served = listen::serve(
        listener,
        router,
        cancel,
        limits,
        Some(listen::Tls { acceptor }),
        DRAIN,
    )
    .await;
    reload.abort();
    served
}

/// Serves `router` on `listener` under the default [`Limits`] until `cancel` fires, then drains
/// open requests.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    cancel: CancellationToken,
) -> std::io::Result<()> {
    serve_with(listener, router, cancel, Limits::default(), None).await
}

/// The tests' one request: `req` through `router`, its status and body (as text).
#[cfg(test)]
pub(crate) async fn respond(
    router: Router,
    req: axum::http::Request<axum::body::Body>,
) -> (StatusCode, String) {
    let resp = tower::ServiceExt::oneshot(router, req)
        .await
        .unwrap_or_else(|e| match e {});
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap_or_default();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use std::sync::Mutex;
    use tower::ServiceExt;

    struct Fake {
        taken: Mutex<Vec<SnapshotRequest>>,
        /// Requests wait for this before answering.
        hold: tokio::sync::Notify,
        holding: std::sync::atomic::AtomicBool,
        /// What `take` answers after recording the request (`Ok(None)` when unset).
        answer: Mutex<Option<Result<Option<Snapshot>, ApiError>>>,
        /// The store's latest chain, as a listing reads it when it starts; unreachable when unset.
        chain: Mutex<Option<Latest>>,
        /// Listings started, and in flight now (at most, ever).
        listed: std::sync::atomic::AtomicUsize,
        listing: Arc<std::sync::atomic::AtomicUsize>,
        most_listing: std::sync::atomic::AtomicUsize,
        /// Listings hang while this is false.
        lists_answer: watch::Sender<bool>,
        version: Mutex<StoreVersion>,
    }

    impl Fake {
        fn listed(&self) -> usize {
            self.listed.load(std::sync::atomic::Ordering::SeqCst)
        }

        /// Until `listed` listings started.
        async fn until_listed(&self, listed: usize) {
            while self.listed() < listed {
                tokio::task::yield_now().await;
            }
        }

        fn store_changed(&self) {
            self.version.lock().unwrap().changes += 1;
        }
    }

    /// Counts a listing in flight while it lives (a dropped listing too).
    struct InFlight(Arc<std::sync::atomic::AtomicUsize>);
    impl Drop for InFlight {
        fn drop(&mut self) {
            self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[async_trait]
    impl SnapshotApi for Fake {
        async fn latest(&self) -> Result<Latest, ApiError> {
            use std::sync::atomic::Ordering::SeqCst;
            let read = self.chain.lock().unwrap().clone();
            self.listed.fetch_add(1, SeqCst);
            let now = self.listing.fetch_add(1, SeqCst) + 1;
            let _in_flight = InFlight(self.listing.clone());
            self.most_listing.fetch_max(now, SeqCst);
            let _ = self.lists_answer.subscribe().wait_for(|open| *open).await;
            read.ok_or_else(|| ApiError::unavailable("store unreachable"))
        }
        fn version(&self) -> StoreVersion {
            self.version.lock().unwrap().clone()
        }
        async fn take(&self, what: SnapshotRequest) -> Result<Option<Snapshot>, ApiError> {
            self.taken.lock().unwrap().push(what);
            if self.holding.load(std::sync::atomic::Ordering::SeqCst) {
                self.hold.notified().await;
            }
            self.answer.lock().unwrap().clone().unwrap_or(Ok(None))
        }
    }

    struct NoStatus;
    impl StatusSource for NoStatus {
        fn status(&self) -> serde_json::Value {
            serde_json::json!({"owner": null})
        }
    }

    fn state(ready: bool, token: Option<&str>) -> (ServerState, Arc<Fake>) {
        let (_tx, rx) = watch::channel(Readiness {
            ready,
            state: "Active".into(),
            reason: "test".into(),
        });
        let fake = Arc::new(Fake {
            taken: Mutex::new(vec![]),
            hold: tokio::sync::Notify::new(),
            holding: std::sync::atomic::AtomicBool::new(false),
            answer: Mutex::new(None),
            chain: Mutex::new(None),
            listed: Default::default(),
            listing: Default::default(),
            most_listing: Default::default(),
            lists_answer: watch::channel(true).0,
            version: Mutex::new(StoreVersion::default()),
        });
        let (_live_tx, liveness) = watch::channel(None);
        let s = ServerState {
            readiness: rx,
            snapshots: fake.clone(),
            latest: LatestCache::new(std::time::Duration::from_secs(3600)),
            status: Arc::new(NoStatus),
            registry: Arc::new(Registry::default()),
            drill: None,
            token: token.map(|t| Secret::Value(t.into())),
            liveness,
            mutating: Arc::new(tokio::sync::Semaphore::new(1)),
            unauthenticated_snapshots: false,
            client_certs: false,
            ebr_answers: false,
        };
        (s, fake)
    }

    async fn call(s: ServerState, req: Request<Body>) -> (StatusCode, serde_json::Value) {
        let (status, body) = respond(router(s), req).await;
        (
            status,
            serde_json::from_str(&body).unwrap_or(serde_json::Value::Null),
        )
    }

    fn get(path: &str) -> Request<Body> {
        Request::get(path).body(Body::empty()).unwrap()
    }

    #[tokio::test]
    async fn healthz_follows_readiness_and_errors_are_json_with_a_code() {
        let tok = Some("sekrit");
        // (ready, token, path, status, `field=value`s of the body)
        let cases = [
            (true, None, "/healthz", 200, ""),
            (false, None, "/healthz", 503, "state=Active reason=test"),
            (true, None, "/snapshot/latest", 503, "code=unavailable"),
            (true, None, "/nope", 404, "code=not_found"),
            // With a token configured: an unknown route, and readiness refused.
            (false, tok, "/snapshot", 404, "code=not_found"),
            (false, tok, "/healthz", 503, "code=not_ready state=Active"),
        ];
        for (ready, token, path, status, fields) in cases {
            let (code, body) = call(state(ready, token).0, get(path)).await;
            assert_eq!(code, status, "{path} (ready {ready}, token {token:?})");
            for (field, value) in fields.split_whitespace().filter_map(|f| f.split_once('=')) {
                assert_eq!(body[field], value, "{path} (ready {ready}): {body}");
            }
        }
    }

    /// A store's latest chain: a full snapshot at `full` and `deltas` deltas after it.
    fn chain(full: i64, deltas: i64) -> Latest {
        let at = chrono::DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let snap = |kind, start, last| {
            Snapshot::new("", kind, start, last, at, crate::store::Codec::Gzip, false)
        };
        Latest {
            full_snapshot: Some(snap(crate::store::Kind::Full, 0, full)),
            delta_snapshots: (0..deltas)
                .map(|i| snap(crate::store::Kind::Incr, full + i + 1, full + i + 1))
                .collect(),
        }
    }

    async fn latest_body(s: &ServerState) -> (StatusCode, String) {
        respond(router(s.clone()), get("/snapshot/latest")).await
    }

    /// Issue 54, item 6: each `/snapshot/latest` was a LIST of the whole store, so callers asking
    /// at once multiplied it (3.5 GB, `/healthz` at 10 s). Now they wait for the one listing in
    /// flight and share its encoded answer, which later callers get without listing.
    #[tokio::test]
    async fn concurrent_latest_requests_share_one_listing_and_later_ones_none() {
        let (s, fake) = state(true, None);
        *fake.chain.lock().unwrap() = Some(chain(100, 2_000));
        fake.lists_answer.send_replace(false);
        let callers: Vec<_> = (0..200)
            .map(|_| {
                let s = s.clone();
                tokio::spawn(async move { latest_body(&s).await })
            })
            .collect();
        fake.until_listed(1).await;
        // Let every caller reach the handler (a late one finds the answer kept instead).
        for _ in 0..1000 {
            tokio::task::yield_now().await;
        }
        fake.lists_answer.send_replace(true);
        let expected = serde_json::to_string(&chain(100, 2_000)).unwrap();
        for c in callers {
            let (code, body) = c.await.unwrap();
            assert_eq!(code, StatusCode::OK);
            assert!(body == expected, "every caller gets the listing's answer");
        }
        for _ in 0..50 {
            assert_eq!(latest_body(&s).await, (StatusCode::OK, expected.clone()));
        }
        assert_eq!(fake.listed(), 1, "listings for 250 requests");
    }

    #[tokio::test]
    async fn the_answer_after_this_sidecar_stores_a_snapshot_or_learns_of_the_final_is_listed_anew()
    {
        let (s, fake) = state(true, None);
        *fake.chain.lock().unwrap() = Some(chain(10, 1));
        let (_, first) = latest_body(&s).await;
        // Another process wrote to the store: kept until the age runs out (below).
        *fake.chain.lock().unwrap() = Some(chain(10, 2));
        assert_eq!(latest_body(&s).await.1, first);
        assert_eq!(fake.listed(), 1);
        // This sidecar's actor stored a snapshot (the hand-off's final among them).
        let mut fin = chain(30, 0);
        fin.full_snapshot.as_mut().unwrap().is_final = true;
        *fake.chain.lock().unwrap() = Some(fin.clone());
        fake.store_changed();
        let (code, body) = latest_body(&s).await;
        assert_eq!(code, StatusCode::OK);
        let body: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["fullSnapshot"]["isFinal"], true, "{body}");
        assert_eq!(body["fullSnapshot"]["lastRevision"], 30, "{body}");
        assert_eq!(fake.listed(), 2);
        // The watchdog learnt of a final another member's sidecar stored.
        fake.version.lock().unwrap().final_snapshot = Some("Full-…final".into());
        latest_body(&s).await;
        assert_eq!(fake.listed(), 3);
        latest_body(&s).await;
        assert_eq!(fake.listed(), 3);
    }

    #[tokio::test]
    async fn an_answer_is_kept_no_longer_than_its_age() {
        let (mut s, fake) = state(true, None);
        s.latest = LatestCache::new(std::time::Duration::from_millis(1));
        *fake.chain.lock().unwrap() = Some(chain(10, 1));
        for listed in 1..=3 {
            latest_body(&s).await;
            assert_eq!(fake.listed(), listed);
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert_eq!(max_age(std::time::Duration::from_secs(5)).as_secs(), 5);
        assert_eq!(max_age(std::time::Duration::ZERO), MAX_AGE_WITHOUT_DELTAS);
    }

    /// A listing that started before this sidecar stored a snapshot may miss it: a caller after
    /// the store never takes its answer, and still only one LIST runs at a time.
    #[tokio::test]
    async fn a_caller_after_a_store_waits_for_a_listing_started_after_it() {
        let (s, fake) = state(true, None);
        *fake.chain.lock().unwrap() = Some(chain(10, 0));
        fake.lists_answer.send_replace(false);
        let before = tokio::spawn({
            let s = s.clone();
            async move { latest_body(&s).await }
        });
        fake.until_listed(1).await;
        *fake.chain.lock().unwrap() = Some(chain(20, 0));
        fake.store_changed();
        let after = tokio::spawn({
            let s = s.clone();
            async move { latest_body(&s).await }
        });
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(fake.listed(), 1, "the second listing waits for the first");
        fake.lists_answer.send_replace(true);
        let rev = |(_, body): (StatusCode, String)| {
            serde_json::from_str::<serde_json::Value>(&body).unwrap()["fullSnapshot"]
                ["lastRevision"]
                .as_i64()
        };
        assert_eq!(rev(before.await.unwrap()), Some(10));
        assert_eq!(rev(after.await.unwrap()), Some(20));
        assert_eq!(rev(latest_body(&s).await), Some(20));
        assert_eq!(fake.listed(), 2);
        assert_eq!(
            fake.most_listing.load(std::sync::atomic::Ordering::SeqCst),
            1
        );
    }

    #[tokio::test]
    async fn a_failed_listing_is_shared_by_its_callers_and_not_kept() {
        let (s, fake) = state(true, None);
        fake.lists_answer.send_replace(false);
        let callers: Vec<_> = (0..20)
            .map(|_| {
                let s = s.clone();
                tokio::spawn(async move { call(s, get("/snapshot/latest")).await })
            })
            .collect();
        fake.until_listed(1).await;
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        fake.lists_answer.send_replace(true);
        for c in callers {
            let (code, body) = c.await.unwrap();
            assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(body["code"], "unavailable");
        }
        let after_the_flood = fake.listed();
        *fake.chain.lock().unwrap() = Some(chain(5, 0));
        assert_eq!(latest_body(&s).await.0, StatusCode::OK);
        assert_eq!(fake.listed(), after_the_flood + 1);
        assert!(
            after_the_flood <= 2,
            "{after_the_flood} listings for 20 callers"
        );
    }

    /// A store that hangs holds one listing while someone waits for it, none after: the next
    /// caller lists afresh instead of waiting behind a listing nobody wants.
    #[tokio::test]
    async fn a_listing_every_caller_gave_up_on_is_dropped() {
        let (s, fake) = state(true, None);
        *fake.chain.lock().unwrap() = Some(chain(10, 0));
        fake.lists_answer.send_replace(false);
        let gives_up = tokio::spawn({
            let s = s.clone();
            async move { latest_body(&s).await }
        });
        fake.until_listed(1).await;
        gives_up.abort();
        let _ = gives_up.await;
        assert_eq!(fake.listing.load(std::sync::atomic::Ordering::SeqCst), 0);
        fake.lists_answer.send_replace(true);
        assert_eq!(latest_body(&s).await.0, StatusCode::OK);
        assert_eq!(fake.listed(), 2);
    }

    /// `/healthz` reads readiness from memory: it answers while every listing hangs.
    #[tokio::test]
    async fn healthz_answers_while_the_store_listing_hangs() {
        let (s, fake) = state(true, None);
        *fake.chain.lock().unwrap() = Some(chain(10, 0));
        fake.lists_answer.send_replace(false);
        let waiting: Vec<_> = (0..50)
            .map(|_| {
                let s = s.clone();
                tokio::spawn(async move { latest_body(&s).await })
            })
            .collect();
        fake.until_listed(1).await;
        for _ in 0..20 {
            let answered = tokio::time::timeout(
                std::time::Duration::from_secs(5),
                call(s.clone(), get("/healthz")),
            )
            .await
            .expect("/healthz answers while the listing hangs");
            assert_eq!(answered.0, StatusCode::OK);
        }
        assert!(waiting.iter().all(|w| !w.is_finished()));
        fake.lists_answer.send_replace(true);
        for w in waiting {
            assert_eq!(w.await.unwrap().0, StatusCode::OK);
        }
        assert_eq!(fake.listed(), 1);
    }

    #[tokio::test]
    async fn authorization_comes_before_the_query_and_every_error_is_json_with_a_code() {
        let (s, fake) = state(false, Some("sekrit"));
        // Whoever has no token learns nothing about the query: 401, not 400.
        for method in [Method::POST, Method::GET] {
            let (code, body) = call(
                s.clone(),
                request(method.clone(), None, "/snapshot/full?final=maybe"),
            )
            .await;
            assert_eq!(code, StatusCode::UNAUTHORIZED, "{method}");
            assert_eq!(body["code"], "unauthorized", "{method}");
        }
        // With the token, the bad query is 400 naming the parameter, and nothing is taken.
        let (code, body) = call(
            s.clone(),
            request(
                Method::POST,
                Some("Bearer sekrit"),
                "/snapshot/full?final=maybe",
            ),
        )
        .await;
        assert_eq!(code, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(body["code"], "bad_query");
        assert!(
            body["message"].as_str().unwrap().contains("final"),
            "{body}"
        );
        assert!(fake.taken.lock().unwrap().is_empty());

        // A method a route does not take: 405 as JSON, axum's Allow header kept.
        for (method, path, allowed) in [
            (Method::DELETE, "/snapshot/full", "POST"),
            (Method::PUT, "/snapshot/delta", "GET"),
            (Method::POST, "/healthz", "GET"),
            (Method::POST, "/snapshot/latest", "GET"),
            (Method::PATCH, "/status", "GET"),
        ] {
            let resp = router(s.clone())
                .oneshot(request(method.clone(), None, path))
                .await
                .unwrap();
            assert_eq!(
                resp.status(),
                StatusCode::METHOD_NOT_ALLOWED,
                "{method} {path}"
            );
            let allow = resp.headers()[header::ALLOW].to_str().unwrap().to_string();
            assert!(allow.contains(allowed), "{method} {path}: Allow {allow}");
            let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
                .await
                .unwrap();
            let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            assert_eq!(body["code"], "method_not_allowed", "{method} {path}");
        }
        // An unknown route and readiness refused, with the token configured: JSON with a code
        // too (rows of healthz_follows_readiness_and_errors_are_json_with_a_code).
    }

    #[tokio::test]
    async fn mutating_endpoints_need_the_token_when_configured() {
        let (s, fake) = state(true, Some("sekrit"));
        let post = |auth: Option<&str>, path: &str| {
            let mut b = Request::post(path);
            if let Some(a) = auth {
                b = b.header("authorization", a);
            }
            b.body(Body::empty()).unwrap()
        };
        assert_eq!(
            call(s.clone(), post(None, "/snapshot/full")).await.0,
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            call(s.clone(), post(Some("Bearer wrong"), "/snapshot/delta"))
                .await
                .0,
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            call(
                s.clone(),
                post(Some("Bearer sekrit"), "/snapshot/full?final=true")
            )
            .await
            .0,
            StatusCode::NO_CONTENT
        );
        assert_eq!(
            call(s, post(Some("Bearer sekrit"), "/snapshot/delta"))
                .await
                .0,
            StatusCode::NO_CONTENT
        );
        assert_eq!(
            *fake.taken.lock().unwrap(),
            vec![
                SnapshotRequest::Full { is_final: true },
                SnapshotRequest::Delta
            ]
        );
    }

    fn request(method: Method, auth: Option<&str>, path: &str) -> Request<Body> {
        let mut b = Request::builder().method(method).uri(path);
        if let Some(a) = auth {
            b = b.header("authorization", a);
        }
        b.body(Body::empty()).unwrap()
    }

    /// Under etcd-druid, `POST` answers 200 with the snapshot or `null`, as `GET` does.
    #[tokio::test]
    async fn under_druid_post_answers_as_get() {
        let (mut s, fake) = state(true, None);
        s.ebr_answers = true;
        *fake.answer.lock().unwrap() = None;
        let (code, body) = call(s.clone(), request(Method::POST, None, "/snapshot/delta")).await;
        assert_eq!((code, body), (StatusCode::OK, serde_json::Value::Null));
        let snap = Snapshot::new(
            "v2/",
            crate::store::Kind::Full,
            0,
            7,
            chrono::DateTime::from_timestamp(1_700_000_000, 0).unwrap(),
            crate::store::Codec::Gzip,
            false,
        );
        *fake.answer.lock().unwrap() = Some(Ok(Some(snap.clone())));
        let (code, body) = call(s.clone(), request(Method::POST, None, "/snapshot/full")).await;
        assert_eq!(code, StatusCode::OK);
        assert_eq!(body["snapName"], snap.snap_name);
        assert_eq!(body["isChunk"], false);
    }

    /// Under etcd-druid (`ebr_answers`, open triggers, no token: etcdbrctl's defaults), a final
    /// is druid's requested final: asked of the snapshots as such (never as the hand-off's
    /// final), by either method, without a token, and answered 200 with the snapshot.
    #[tokio::test]
    async fn under_druid_a_final_is_druids_requested_final_without_a_token() {
        let (mut s, fake) = state(true, None);
        s.ebr_answers = true;
        s.unauthenticated_snapshots = true;
        let snap = Snapshot::new(
            "v2/",
            crate::store::Kind::Full,
            0,
            9,
            chrono::DateTime::from_timestamp(1_700_000_000, 0).unwrap(),
            crate::store::Codec::Gzip,
            true,
        );
        *fake.answer.lock().unwrap() = Some(Ok(Some(snap.clone())));
        for method in [Method::POST, Method::GET] {
            let (code, body) = call(
                s.clone(),
                request(method.clone(), None, "/snapshot/full?final=true"),
            )
            .await;
            assert_eq!(code, StatusCode::OK, "{method}: {body}");
            assert_eq!(body["snapName"], snap.snap_name);
            assert_eq!(body["isFinal"], true);
        }
        assert_eq!(
            *fake.taken.lock().unwrap(),
            vec![SnapshotRequest::RequestedFinal; 2]
        );
        // Outside druid the same request stays the hand-off's, and needs a caller.
        s.ebr_answers = false;
        let (code, body) = call(
            s.clone(),
            request(Method::POST, None, "/snapshot/full?final=true"),
        )
        .await;
        assert_eq!(
            (code, &body["code"]),
            (StatusCode::FORBIDDEN, &"final_needs_token".into())
        );
        assert_eq!(fake.taken.lock().unwrap().len(), 2);
    }

    /// `server.unauthenticated_snapshots` (etcd-druid's callers send no token): regular triggers
    /// open to anyone, a final only with the token, and refused when none is configured.
    #[tokio::test]
    async fn open_triggers_are_open_for_regular_snapshots_only() {
        for token in [None, Some("sekrit")] {
            let (mut s, fake) = state(true, token);
            s.unauthenticated_snapshots = true;
            *fake.answer.lock().unwrap() = None;
            for (method, path) in [
                (Method::GET, "/snapshot/full"),
                (Method::POST, "/snapshot/full"),
                (Method::GET, "/snapshot/delta"),
                (Method::POST, "/snapshot/delta"),
            ] {
                let (code, body) = call(s.clone(), request(method.clone(), None, path)).await;
                assert!(
                    code.is_success(),
                    "{method} {path} with {token:?}: {code} {body}"
                );
            }
            let (code, body) = call(
                s.clone(),
                request(Method::GET, None, "/snapshot/full?final=true"),
            )
            .await;
            match token {
                None => {
                    assert_eq!(code, StatusCode::FORBIDDEN);
                    assert_eq!(body["code"], "final_needs_token");
                }
                Some(_) => assert_eq!(code, StatusCode::UNAUTHORIZED),
            }
            if token.is_some() {
                let (code, _) = call(
                    s.clone(),
                    request(
                        Method::GET,
                        Some("Bearer sekrit"),
                        "/snapshot/full?final=true",
                    ),
                )
                .await;
                assert!(code.is_success() || code == StatusCode::CONFLICT, "{code}");
            }
        }
    }

    #[tokio::test]
    async fn get_triggers_snapshots_under_the_rules_of_post() {
        let (s, fake) = state(true, Some("sekrit"));
        let ok = Some("Bearer sekrit");
        // The token.
        for path in [
            "/snapshot/full",
            "/snapshot/delta",
            "/snapshot/full?final=true",
        ] {
            let (code, body) = call(s.clone(), request(Method::GET, None, path)).await;
            assert_eq!(code, StatusCode::UNAUTHORIZED, "{path}");
            assert_eq!(body["code"], "unauthorized");
        }
        assert!(fake.taken.lock().unwrap().is_empty());

        // A stored full snapshot: GET answers 200 with its JSON (what etcd-druid requires), POST
        // keeps answering 201.
        let snap = Snapshot::new(
            "v2/",
            crate::store::Kind::Full,
            0,
            42,
            chrono::DateTime::from_timestamp(1_700_000_000, 0).unwrap(),
            crate::store::Codec::Gzip,
            false,
        );
        *fake.answer.lock().unwrap() = Some(Ok(Some(snap.clone())));
        // etcd-backup-restore's `Snapshot` JSON: etcd-warden's fields and its zero values.
        let mut ebr = serde_json::to_value(&snap).unwrap();
        for (field, zero) in [
            ("snapDir", serde_json::json!("")),
            ("isChunk", serde_json::json!(false)),
            ("versionID", serde_json::Value::Null),
            (
                "immutabilityExpriyTime",
                serde_json::json!("0001-01-01T00:00:00Z"),
            ),
        ] {
            ebr[field] = zero;
        }
        let (code, body) = call(s.clone(), request(Method::GET, ok, "/snapshot/full")).await;
        assert_eq!(code, StatusCode::OK);
        assert_eq!(body, ebr);
        let (code, body) = call(s.clone(), request(Method::POST, ok, "/snapshot/full")).await;
        assert_eq!(code, StatusCode::CREATED);
        assert_eq!(body, ebr);

        // A delta with nothing to write: 200 and `null` for GET, 204 for POST.
        *fake.answer.lock().unwrap() = None;
        let (code, body) = call(s.clone(), request(Method::GET, ok, "/snapshot/delta")).await;
        assert_eq!((code, body), (StatusCode::OK, serde_json::Value::Null));
        let (code, _) = call(s.clone(), request(Method::POST, ok, "/snapshot/delta")).await;
        assert_eq!(code, StatusCode::NO_CONTENT);

        // `final=true` asks for the hand-off's final, and what the protocol refuses is 409.
        *fake.answer.lock().unwrap() = Some(Err(ApiError::new(
            StatusCode::CONFLICT,
            "not_deactivated",
            "a final snapshot is only taken after ownership is lost",
        )));
        let (code, body) = call(
            s.clone(),
            request(Method::GET, ok, "/snapshot/full?final=true"),
        )
        .await;
        assert_eq!(code, StatusCode::CONFLICT);
        assert_eq!(body["code"], "not_deactivated");
        assert_eq!(
            *fake.taken.lock().unwrap(),
            vec![
                SnapshotRequest::Full { is_final: false },
                SnapshotRequest::Full { is_final: false },
                SnapshotRequest::Delta,
                SnapshotRequest::Delta,
                SnapshotRequest::Full { is_final: true },
            ]
        );

        // One at a time, whatever the method: a GET while a POST is in flight is 429, and the
        // other way round.
        *fake.answer.lock().unwrap() = None;
        fake.taken.lock().unwrap().clear();
        fake.holding
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let first = tokio::spawn(call(s.clone(), request(Method::POST, ok, "/snapshot/full")));
        while fake.taken.lock().unwrap().is_empty() {
            tokio::task::yield_now().await;
        }
        for path in ["/snapshot/full", "/snapshot/delta"] {
            let (code, body) = call(s.clone(), request(Method::GET, ok, path)).await;
            assert_eq!(code, StatusCode::TOO_MANY_REQUESTS, "{path}");
            assert_eq!(body["code"], "busy");
        }
        fake.holding
            .store(false, std::sync::atomic::Ordering::SeqCst);
        fake.hold.notify_one();
        assert_eq!(first.await.unwrap().0, StatusCode::NO_CONTENT);

        fake.holding
            .store(true, std::sync::atomic::Ordering::SeqCst);
        fake.taken.lock().unwrap().clear();
        let first = tokio::spawn(call(s.clone(), request(Method::GET, ok, "/snapshot/delta")));
        while fake.taken.lock().unwrap().is_empty() {
            tokio::task::yield_now().await;
        }
        let (code, _) = call(s.clone(), request(Method::POST, ok, "/snapshot/full")).await;
        assert_eq!(code, StatusCode::TOO_MANY_REQUESTS);
        fake.holding
            .store(false, std::sync::atomic::Ordering::SeqCst);
        fake.hold.notify_one();
        assert_eq!(first.await.unwrap().0, StatusCode::OK);
    }

    #[tokio::test]
    async fn status_includes_readiness() {
        let (s, _) = state(false, None);
        let (code, body) = call(s, get("/status")).await;
        assert_eq!(code, StatusCode::OK);
        assert_eq!(body["readiness"]["ready"], false);
        assert!(body.get("owner").is_some());
    }

    #[tokio::test]
    async fn one_mutating_request_at_a_time() {
        let (s, fake) = state(true, None);
        fake.holding
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let post = |path: &str| Request::post(path).body(Body::empty()).unwrap();
        let first = tokio::spawn(call(s.clone(), post("/snapshot/full")));
        // Wait until the first request is inside the handler.
        while fake.taken.lock().unwrap().is_empty() {
            tokio::task::yield_now().await;
        }
        let (code, body) = call(s.clone(), post("/snapshot/delta")).await;
        assert_eq!(code, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(body["code"], "busy");
        fake.holding
            .store(false, std::sync::atomic::Ordering::SeqCst);
        fake.hold.notify_one();
        assert_eq!(first.await.unwrap().0, StatusCode::NO_CONTENT);
        assert_eq!(
            call(s, post("/snapshot/delta")).await.0,
            StatusCode::NO_CONTENT
        );
    }

    #[tokio::test]
    async fn livez_turns_503_with_the_reason_once_a_task_ended() {
        let (mut s, _) = state(true, None);
        let (tx, rx) = watch::channel(None);
        s.liveness = rx;
        assert_eq!(call(s.clone(), get("/livez")).await.0, StatusCode::OK);
        tx.send_replace(Some("the ownership watchdog panicked".into()));
        let (code, body) = call(s, get("/livez")).await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["message"], "the ownership watchdog panicked");
    }

    #[test]
    fn failed_readiness_is_sticky_and_never_ready() {
        let (tx, rx) = watch::channel(Readiness::starting());
        set_readiness(&tx, true, "active", "owner");
        assert!(rx.borrow().ready);
        set_readiness(&tx, false, FAILED, "critical task snapshot actor ended");
        // The watchdog, still running until it is cancelled, finishes a check.
        set_readiness(&tx, true, "active", "owner");
        set_readiness(&tx, false, "deactivated", "not owner");
        let r = rx.borrow().clone();
        assert!(!r.ready);
        assert_eq!(r.state, FAILED);
        assert_eq!(r.reason, "critical task snapshot actor ended");
        // Failed is never ready, whoever asks.
        set_readiness(&tx, true, FAILED, "a second task ended");
        let r = rx.borrow().clone();
        assert!(!r.ready);
        assert_eq!(r.reason, "a second task ended");
    }

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"a"));
    }
}
