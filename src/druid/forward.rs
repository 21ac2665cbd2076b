//! Snapshot triggers that reach a follower's sidecar go to the leader's, as etcd-backup-restore
//! forwards them (`delegateReqToLeader`): druid calls `/snapshot/full` and `/snapshot/delta`
//! through the `<etcd>-client` Service, which picks any ready pod, while only the sidecar next to
//! the raft leader collects deltas (a delta asked of a follower would otherwise be a 409, and a
//! full snapshot would come from a member that may lag).
//!
//! The leader's sidecar is found as etcd-backup-restore finds it: the local etcd's status names
//! the leader, the member list its first client URL, and the sidecar listens on that host at this
//! sidecar's own port (every pod of a StatefulSet listens on the same one), over HTTPS when this
//! sidecar serves HTTPS, trusting etcd's CA (`--cacert`) as etcd-backup-restore does. The request
//! keeps its method, path, query and `Authorization` header and carries [`FORWARDED`], so a
//! request that finds leadership moved again is answered where it lands, never forwarded twice.
//! What cannot be forwarded (no leader known, the leader's sidecar unreachable) is answered with
//! 503 and the reason. A final (`?final=true`) is forwarded too: under `[druid]` it is druid's
//! requested final, a full snapshot to be taken where the writes are, by the leader; once the
//! members are handed off, every member's sidecar (the leader's too) answers it with the
//! hand-off's final.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::server::ApiError;

/// Marks a forwarded request.
pub const FORWARDED: &str = "x-etcd-warden-forwarded";

/// Where the leader's sidecar is, when this one's member does not lead.
#[async_trait]
pub trait Leadership: Send + Sync {
    /// `None` when this sidecar's member leads; else the leader's client URL, or why it is not
    /// known.
    async fn leader_elsewhere(&self) -> Result<Option<String>, String>;
}

/// The forwarding middleware's state.
#[derive(Clone)]
pub struct Forwarder {
    pub leadership: Arc<dyn Leadership>,
    /// This sidecar's port: the leader's listens on the same.
    pub port: u16,
    /// `https` when this sidecar serves HTTPS.
    pub scheme: &'static str,
    pub http: reqwest::Client,
}

/// The leader's sidecar URL for `path_and_query`, from the leader's etcd client URL.
pub fn leader_url(
    client_url: &str,
    scheme: &str,
    port: u16,
    path_and_query: &str,
) -> Result<String, String> {
    let url = url::Url::parse(client_url)
        .map_err(|e| format!("the leader's client URL {client_url:?}: {e}"))?;
    let host = url
        .host_str()
        .ok_or_else(|| format!("the leader's client URL {client_url:?} has no host"))?;
    // An IPv6 host comes bracketed already.
    Ok(format!("{scheme}://{host}:{port}{path_and_query}"))
}

/// Whether a request is a snapshot trigger a follower forwards.
fn forwardable(req: &Request) -> bool {
    let path = req.uri().path();
    (path == "/snapshot/delta" || path == "/snapshot/full")
        && !req.headers().contains_key(FORWARDED)
}

/// The middleware: a snapshot trigger on a follower goes to the leader's sidecar.
pub async fn forward_to_leader(State(f): State<Forwarder>, req: Request, next: Next) -> Response {
    if !forwardable(&req) {
        return next.run(req).await;
    }
    let leader = match f.leadership.leader_elsewhere().await {
        Ok(None) => return next.run(req).await,
        Ok(Some(url)) => url,
        Err(why) => {
            return ApiError::unavailable(format!(
                "this member does not lead and the leader is not known: {why}"
            ))
            .into_response();
        }
    };
    let path = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let target = match leader_url(&leader, f.scheme, f.port, &path) {
        Ok(t) => t,
        Err(e) => return ApiError::unavailable(e).into_response(),
    };
    tracing::debug!(%target, "snapshot request forwarded to the leader's sidecar");
    let mut out = f
        .http
        .request(req.method().clone(), &target)
        .header(FORWARDED, HeaderValue::from_static("1"));
    if let Some(auth) = req.headers().get(header::AUTHORIZATION) {
        out = out.header(header::AUTHORIZATION, auth.clone());
    }
    match out.send().await {
        Ok(r) => {
            let status =
                StatusCode::from_u16(r.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
            let content_type = r.headers().get(header::CONTENT_TYPE).cloned();
            match r.bytes().await {
                Ok(body) => {
                    let mut resp = Response::new(Body::from(body));
                    *resp.status_mut() = status;
                    if let Some(ct) = content_type {
                        resp.headers_mut().insert(header::CONTENT_TYPE, ct);
                    }
                    resp
                }
                Err(e) => ApiError::unavailable(format!("the leader's sidecar at {target}: {e}"))
                    .into_response(),
            }
        }
        Err(e) => {
            ApiError::unavailable(format!("the leader's sidecar at {target}: {e}")).into_response()
        }
    }
}

/// Leadership read from the local etcd: its status names the leader, the member list the
/// leader's client URLs.
pub struct EtcdLeadership {
    pub etcd: crate::config::EtcdConfig,
}

#[async_trait]
impl Leadership for EtcdLeadership {
    async fn leader_elsewhere(&self) -> Result<Option<String>, String> {
        let asked = tokio::time::timeout(Duration::from_secs(10), async {
            let mut c = crate::etcd::connect(&self.etcd)
                .await
                .map_err(|e| e.to_string())?;
            let status = c.status().await.map_err(|e| e.to_string())?;
            let me = status.header().map(|h| h.member_id()).unwrap_or_default();
            let leader = status.leader();
            if leader == 0 {
                return Err("etcd has no leader".to_string());
            }
            if leader == me {
                return Ok(None);
            }
            let members = c.member_list().await.map_err(|e| e.to_string())?;
            members
                .members()
                .iter()
                .find(|m| m.id() == leader)
                .and_then(|m| m.client_urls().first().cloned())
                .map(Some)
                .ok_or_else(|| format!("the leader {leader:x} lists no client URL"))
        })
        .await;
        asked.unwrap_or_else(|_| Err("etcd did not answer within 10s".into()))
    }
}

/// A client for the leader's sidecar: `ca` (etcd's CA file) trusted besides the system's roots;
/// no timeout beyond the snapshot's own (`snapshot_timeout` and a minute).
pub fn client(
    ca: Option<&std::path::Path>,
    snapshot_timeout: Duration,
) -> Result<reqwest::Client, String> {
    let mut b = reqwest::Client::builder().timeout(snapshot_timeout + Duration::from_secs(60));
    if let Some(ca) = ca {
        let pem = std::fs::read(ca).map_err(|e| format!("{}: {e}", ca.display()))?;
        let cert =
            reqwest::Certificate::from_pem(&pem).map_err(|e| format!("{}: {e}", ca.display()))?;
        b = b.add_root_certificate(cert);
    }
    b.build().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::Router;
    use axum::routing::get;

    struct Fixed(Result<Option<String>, String>);

    #[async_trait]
    impl Leadership for Fixed {
        async fn leader_elsewhere(&self) -> Result<Option<String>, String> {
            self.0.clone()
        }
    }

    #[test]
    fn the_leaders_sidecar_is_its_client_host_at_our_port() {
        assert_eq!(
            leader_url(
                "https://etcd-main-1.etcd-main-peer.ns.svc:2379",
                "https",
                8080,
                "/snapshot/delta"
            ),
            Ok("https://etcd-main-1.etcd-main-peer.ns.svc:8080/snapshot/delta".into())
        );
        assert_eq!(
            leader_url("http://[::1]:2379", "http", 9, "/snapshot/full?x=1"),
            Ok("http://[::1]:9/snapshot/full?x=1".into())
        );
        assert!(leader_url("not a url", "http", 1, "/").is_err());
    }

    /// A sidecar whose own handlers say "local", in front of a leader's that says "leader".
    async fn answers(
        leadership: Fixed,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
    ) -> (u16, String) {
        let leader = Router::new()
            .route(
                "/snapshot/delta",
                get(|h: axum::http::HeaderMap| async move {
                    format!(
                        "leader {}",
                        h.get(header::AUTHORIZATION)
                            .map_or("", |v| v.to_str().unwrap())
                    )
                })
                .post(|| async { "leader post" }),
            )
            .route(
                "/snapshot/full",
                get(|uri: axum::http::Uri| async move {
                    format!(
                        "leader full{}",
                        uri.query().map_or(String::new(), |q| format!("?{q}"))
                    )
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move { axum::serve(listener, leader).await.unwrap() });
        let f = Forwarder {
            leadership: Arc::new(leadership),
            port,
            scheme: "http",
            http: reqwest::Client::new(),
        };
        let app = Router::new()
            .route(
                "/snapshot/delta",
                get(|| async { "local" }).post(|| async { "local" }),
            )
            .route("/snapshot/full", get(|| async { "local" }))
            .layer(axum::middleware::from_fn_with_state(f, forward_to_leader));
        let mut req = Request::builder().method(method).uri(path);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let (code, body) = crate::server::respond(app, req.body(Body::empty()).unwrap()).await;
        (code.as_u16(), body)
    }

    #[tokio::test]
    async fn a_follower_forwards_triggers_and_druids_final_once() {
        let elsewhere = || Fixed(Ok(Some("http://127.0.0.1:2379".into())));
        assert_eq!(
            answers(
                elsewhere(),
                "GET",
                "/snapshot/delta",
                &[("authorization", "Bearer t")]
            )
            .await,
            (200, "leader Bearer t".into())
        );
        assert_eq!(
            answers(elsewhere(), "POST", "/snapshot/delta", &[]).await,
            (200, "leader post".into())
        );
        assert_eq!(
            answers(elsewhere(), "GET", "/snapshot/full", &[]).await,
            (200, "leader full".into())
        );
        // druid's requested final is the leader's to take; a forwarded request is answered
        // where it lands.
        assert_eq!(
            answers(elsewhere(), "GET", "/snapshot/full?final=true", &[]).await,
            (200, "leader full?final=true".into())
        );
        assert_eq!(
            answers(elsewhere(), "GET", "/snapshot/delta", &[(FORWARDED, "1")])
                .await
                .1,
            "local"
        );
        // The leader answers itself.
        assert_eq!(
            answers(Fixed(Ok(None)), "GET", "/snapshot/delta", &[])
                .await
                .1,
            "local"
        );
        // No leader known: 503 with the reason.
        let (code, body) = answers(
            Fixed(Err("etcd has no leader".into())),
            "GET",
            "/snapshot/delta",
            &[],
        )
        .await;
        assert_eq!(code, 503);
        assert!(body.contains("etcd has no leader"), "{body}");
    }
}
