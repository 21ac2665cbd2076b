//! An HTTP proxy on loopback that records every request's method, path, query and headers
//! before passing it on to an upstream server, and passes the answer back unchanged. With
//! `authorization` set, the request's `Authorization` is replaced (recorded first): a stand-in
//! service that authenticates otherwise than its upstream (a GCS bearer token in front of S3).

use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;

/// One request as the proxy received it.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    pub query: String,
    pub headers: reqwest::header::HeaderMap,
}

impl Recorded {
    /// A header's value, if present and text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

#[derive(Clone)]
struct Proxy {
    upstream: String,
    authorization: Option<String>,
    seen: Arc<Mutex<Vec<Recorded>>>,
    http: reqwest::Client,
}

/// The proxy; stops with the test's runtime.
pub struct Recorder {
    pub port: u16,
    seen: Arc<Mutex<Vec<Recorded>>>,
}

impl Recorder {
    /// Proxies to `upstream` (`http://host:port`), replacing `Authorization` when given.
    pub async fn start(upstream: &str, authorization: Option<&str>) -> Recorder {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::<Mutex<Vec<Recorded>>>::default();
        let proxy = Proxy {
            upstream: upstream.trim_end_matches('/').to_string(),
            authorization: authorization.map(str::to_string),
            seen: seen.clone(),
            http: reqwest::Client::new(),
        };
        let app = axum::Router::new().fallback(forward).with_state(proxy);
        tokio::spawn(async move { axum::serve(listener, app).await });
        Recorder { port, seen }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.seen.lock().unwrap().clone()
    }
}

async fn forward(State(p): State<Proxy>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let mut headers = parts.headers.clone();
    p.seen.lock().unwrap().push(Recorded {
        method: parts.method.to_string(),
        path: parts.uri.path().to_string(),
        query: parts.uri.query().unwrap_or_default().to_string(),
        headers: headers.clone(),
    });
    headers.remove(reqwest::header::HOST);
    if let Some(a) = &p.authorization {
        headers.insert(reqwest::header::AUTHORIZATION, a.parse().unwrap());
    }
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    let url = format!(
        "{}{}",
        p.upstream,
        parts.uri.path_and_query().map_or("/", |pq| pq.as_str())
    );
    let method = reqwest::Method::from_bytes(parts.method.as_str().as_bytes()).unwrap();
    let answer = p
        .http
        .request(method, url)
        .headers(headers)
        .body(body)
        .send()
        .await
        .expect("the upstream answers");
    let mut response = Response::builder().status(answer.status().as_u16());
    for (k, v) in answer.headers() {
        response = response.header(k.as_str(), v.as_bytes());
    }
    response
        .body(Body::from(answer.bytes().await.unwrap_or_default()))
        .unwrap()
}
