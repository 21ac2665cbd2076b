//! A Kubernetes API server double: a small HTTP server on a loopback port that the real kube-rs
//! client (and so the operator binary, through a kubeconfig) talks to as to a kube-apiserver.
//!
//! No kube-apiserver can be installed on these machines, and the existing doubles fall short of
//! what the operator's safety depends on: the crate `kube-fake-client` serves no watch and is no
//! HTTP server; PyPI `kmock` (0.8) answers every list with the literal resourceVersion `"..."`,
//! replays the whole state on every watch whatever its resourceVersion, and applies every update
//! as a merge patch without a resourceVersion check, so a stale write never gets its 409.
//!
//! # What it does
//! Generic over resources: any `/api/v1/...` or `/apis/{group}/{version}/...` path is a resource,
//! its objects stored as JSON by (group, version, plural, namespace, name).
//! - **list** with `metadata.resourceVersion` in the list; `labelSelector` (`k=v`, `k==v`, `k!=v`,
//!   `k in (a,b)`, `k notin (a,b)`, `k`, `!k`) and `fieldSelector` (`metadata.name`,
//!   `metadata.namespace`, `=`/`==`/`!=`); namespaced and all-namespaces paths.
//! - **watch** (`?watch=true`): newline-delimited `WatchEvent`s. Without `resourceVersion` (or
//!   with `0`) an `ADDED` per current object first; with `resourceVersion=N` every event after N
//!   from the history, then live events. An object that starts or stops matching the selector is
//!   `ADDED` or `DELETED`, as the watch cache does. After [`ApiServer::compact`], a watch from an
//!   older version gets one `ERROR` event with a 410 `Expired` Status. `timeoutSeconds` ends the
//!   stream.
//! - **get**, **create** (`generateName`, `uid`, `creationTimestamp`, `generation`; 409
//!   `AlreadyExists`; a `resourceVersion` on create is refused with 422, as upstream),
//!   **update** (PUT), **JSON merge patch** and **JSON patch** (`add`, `remove`, `replace`,
//!   `test`; a failed `test` is 422 `Invalid`, as upstream, not 409).
//! - **Optimistic concurrency**: one global, monotonically increasing resourceVersion; a PUT, a
//!   merge patch or a delete precondition carrying a stale `metadata.resourceVersion` gets 409
//!   `Conflict`. A write that changes nothing keeps the resourceVersion and emits no event.
//! - **Deletion**: an object with finalizers gets `deletionTimestamp` (a `MODIFIED` event) and
//!   stays until an update removes the last finalizer, then it goes (`DELETED`); no new finalizer
//!   may be added while deleting (422); `deletionTimestamp` cannot be changed by a write.
//! - **Status subresource** for the resources named in [`ApiServer::start`]'s defaults or by
//!   [`ApiServer::status_subresource`]: writes to the object ignore `status` (create drops it),
//!   writes to `/status` change only `status`.
//! - `metadata.generation` grows when anything but `metadata` and `status` changes.
//! - Errors are `Status` bodies (`kind: Status`, `code`, `reason`, `details`) that kube-rs parses.
//! - **Conflict injection** ([`ApiServer::inject_conflicts`]): before the first write to each
//!   object a "concurrent writer" changes an annotation, so a writer holding the version it read
//!   gets a real 409 and must read again.
//! - **Resource types not installed** ([`ApiServer::uninstall`]): every request to them is a
//!   404 with a `Status` of reason `NotFound`, as for a CRD not (yet) created.
//! - **`OwnerReferencesPermissionEnforcement`** ([`ApiServer::enforce_owner_references`],
//!   OpenShift's default admission): a write that changes an object's owner references needs
//!   `delete` on the object (creates excepted), and one that sets `blockOwnerDeletion: true` on
//!   a reference needs `update` on the owner's `<resource>/finalizers` (named, in the object's
//!   namespace), both per the RBAC policy given (`support::rbac`), else 403 `Forbidden` with the
//!   plugin's message. The owner's resource is its kind lower-cased plus `s` (no RESTMapper).
//! - **Garbage collector** ([`ApiServer::collect_garbage`]), as kube-controller-manager's runs,
//!   but synchronously after every write (so it always wins a race with a controller): a
//!   delete's `propagationPolicy` `Orphan` or `Foreground` puts the `orphan` or
//!   `foregroundDeletion` finalizer on the object; for an `orphan` owner the collector takes the
//!   owner's references off its dependents, then the finalizer off; for a `foregroundDeletion`
//!   owner it deletes every dependent (one with another owner still there loses only the
//!   reference), and takes the finalizer off once no dependent with `blockOwnerDeletion: true`
//!   is left; an object whose owners are all gone is deleted (`Background`, the default for
//!   custom resources). What it deleted is in [`ApiServer::collected`].
//!
//! # What it does NOT check
//! No schema validation or defaulting (any JSON is stored; unknown fields are kept, not pruned),
//! no CRD registration (every path is a resource, unless [`ApiServer::uninstall`]ed), no discovery endpoints (`/api`, `/apis`), no version conversion
//! (each version is a separate store), no authentication, RBAC or admission (the Machine API's
//! webhooks included: nothing stops a lifecycle hook being added to a deleting Machine here), no
//! real server-side apply (an apply to an existing object is served as a JSON merge patch of
//! the applied object: no field ownership or conflicts, no `managedFields`, no removal of fields
//! a manager stopped applying, no create through apply, which is 404 here), no strategic merge
//! patch (415), no field managers,
//! no garbage collection unless turned on, no `deletecollection`, no pagination (`limit` and
//! `continue` are ignored: one page), no `resourceVersionMatch` or `sendInitialEvents`, no
//! `BOOKMARK` events, no graceful deletion periods (pods go at once), unconditional updates are
//! allowed for every resource (upstream refuses them for custom resources), and the Namespace
//! resource's `/status` is not routed. Names are not validated.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

/// The header naming who made a request, for [`ApiServer::requests_of`].
const USER_HEADER: &str = "x-double-user";

/// Resources served with a status subresource unless told otherwise: (group, plural).
const STATUS_SUBRESOURCES: &[(&str, &str)] = &[
    ("machine.openshift.io", "machines"),
    ("policy", "poddisruptionbudgets"),
    ("apps", "deployments"),
    ("apps", "statefulsets"),
    ("", "pods"),
];

/// A resource type: group (empty for the core group), version, plural.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Res {
    /// API group; empty for core.
    pub group: String,
    /// Version.
    pub version: String,
    /// Plural resource name.
    pub plural: String,
}

impl Res {
    /// A resource of `group/version` named `plural`.
    pub fn new(group: &str, version: &str, plural: &str) -> Res {
        Res {
            group: group.into(),
            version: version.into(),
            plural: plural.into(),
        }
    }

    fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Key {
    res: Res,
    namespace: String,
    name: String,
}

/// One change, as the history keeps it.
#[derive(Debug)]
struct Change {
    rv: u64,
    key: Key,
    old: Option<Value>,
    /// `None` when the object went away.
    new: Option<Value>,
    /// The object as last seen (for `DELETED`, with the deletion's resourceVersion).
    last: Value,
}

struct Store {
    rv: u64,
    uid: u64,
    objects: BTreeMap<Key, Value>,
    history: Vec<Arc<Change>>,
    /// Watches from before this version get 410 Expired.
    floor: u64,
    inject_conflicts: bool,
    /// With conflicts injected: only on these resources (plural names); empty: on every one.
    conflicts_only_on: HashSet<String>,
    conflicted: HashSet<Key>,
    status_subresources: HashSet<(String, String)>,
    /// Every request as `METHOD path?query`, for tests that check what was asked.
    requests: Vec<String>,
    /// (the `x-double-user` header, or empty; the request as in `requests`).
    requests_by: Vec<(String, String)>,
    /// (group, plural) served as not installed.
    uninstalled: HashSet<(String, String)>,
    /// OpenShift's `OwnerReferencesPermissionEnforcement`, when on.
    owner_enforcement: Option<OwnerEnforcement>,
    /// Whether the garbage collector runs.
    gc: bool,
    /// What the garbage collector deleted: (plural, name).
    collected: Vec<(String, String)>,
}

/// Who a user of the `x-double-user` header is, and the RBAC that authorizes them.
struct OwnerEnforcement {
    policy: super::rbac::Policy,
    /// user → (namespace, service account); other users are cluster administrators.
    users: BTreeMap<String, (String, String)>,
}

struct Shared {
    store: Mutex<Store>,
    events: broadcast::Sender<Arc<Change>>,
    /// Cancelled when the double is dropped: open watches end with it.
    stopped: CancellationToken,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The double, serving on `127.0.0.1:<ephemeral>` until dropped.
pub struct ApiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    cancel: CancellationToken,
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl ApiServer {
    /// Starts the double on an ephemeral loopback port.
    pub async fn start() -> ApiServer {
        let (events, _) = broadcast::channel(4096);
        let shared = Arc::new(Shared {
            store: Mutex::new(Store {
                rv: 1,
                uid: 0,
                objects: BTreeMap::new(),
                history: Vec::new(),
                floor: 0,
                inject_conflicts: false,
                conflicts_only_on: HashSet::new(),
                conflicted: HashSet::new(),
                status_subresources: STATUS_SUBRESOURCES
                    .iter()
                    .map(|(g, p)| (g.to_string(), p.to_string()))
                    .collect(),
                requests: Vec::new(),
                requests_by: Vec::new(),
                uninstalled: HashSet::new(),
                owner_enforcement: None,
                gc: false,
                collected: Vec::new(),
            }),
            events,
            stopped: CancellationToken::new(),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the API server double");
        let addr = listener.local_addr().expect("bound address");
        let cancel = shared.stopped.clone();
        let app = Router::new()
            .fallback(handle)
            .with_state(Arc::clone(&shared));
        let stop = cancel.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await;
        });
        ApiServer {
            addr,
            shared,
            cancel,
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kube client for the double (namespace `default`).
    pub fn client(&self) -> kube::Client {
        let uri = self.url().parse().expect("the double's URL");
        kube::Client::try_from(kube::Config::new(uri)).expect("a kube client for the double")
    }

    /// Writes a kubeconfig naming the double (context `double`, namespace `namespace`), for a
    /// binary under test.
    pub fn write_kubeconfig(&self, path: &Path, namespace: &str) {
        self.write_kubeconfig_via(path, namespace, &self.url());
    }

    /// The double's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// As [`Self::write_kubeconfig`], naming `url` as the server (a proxy in front of the
    /// double, which a test can fail).
    pub fn write_kubeconfig_via(&self, path: &Path, namespace: &str, url: &str) {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: double\n  cluster:\n    server: {url}\n\
             users:\n- name: double\n  user: {{}}\ncontexts:\n- name: double\n  context:\n    \
             cluster: double\n    user: double\n    namespace: {namespace}\n\
             current-context: double\n",
        );
        std::fs::write(path, text).expect("write the kubeconfig");
    }

    /// Also serves `group`'s `plural` with a status subresource.
    pub fn status_subresource(&self, group: &str, plural: &str) {
        self.shared
            .lock()
            .status_subresources
            .insert((group.into(), plural.into()));
    }

    /// From now on, a concurrent writer touches each object once, right before the first write
    /// anyone else makes to it (so a conditional write gets a 409 and must read again).
    pub fn inject_conflicts(&self, on: bool) {
        self.inject_conflicts_on(on, &[]);
    }

    /// As [`Self::inject_conflicts`], on the resources `plurals` only (all when empty), so a
    /// test can leave, say, the Lease a leader renews alone.
    pub fn inject_conflicts_on(&self, on: bool, plurals: &[&str]) {
        let mut s = self.shared.lock();
        s.inject_conflicts = on;
        s.conflicts_only_on = plurals.iter().map(|p| p.to_string()).collect();
        s.conflicted.clear();
    }

    /// Serves `group`'s `plural` as not installed (every request 404) until [`Self::install`].
    pub fn uninstall(&self, group: &str, plural: &str) {
        self.shared
            .lock()
            .uninstalled
            .insert((group.into(), plural.into()));
    }

    /// Serves `group`'s `plural` again (its CRD created).
    pub fn install(&self, group: &str, plural: &str) {
        self.shared
            .lock()
            .uninstalled
            .remove(&(group.to_owned(), plural.to_owned()));
    }

    /// Turns on `OwnerReferencesPermissionEnforcement` with `policy`; `users` maps a
    /// [`Self::client_as`] user to the service account (namespace, name) it acts as.
    pub fn enforce_owner_references(
        &self,
        policy: super::rbac::Policy,
        users: &[(&str, (&str, &str))],
    ) {
        self.shared.lock().owner_enforcement = Some(OwnerEnforcement {
            policy,
            users: users
                .iter()
                .map(|(u, (ns, n))| (u.to_string(), (ns.to_string(), n.to_string())))
                .collect(),
        });
    }

    /// Turns on the garbage collector.
    pub fn collect_garbage(&self) {
        let mut s = self.shared.lock();
        s.gc = true;
        let tx = self.shared.events.clone();
        s.collect(&tx);
    }

    /// What the garbage collector deleted, as (plural, name).
    pub fn collected(&self) -> Vec<(String, String)> {
        self.shared.lock().collected.clone()
    }

    /// Forgets the history: watches from an older version get 410 Expired.
    pub fn compact(&self) {
        let mut s = self.shared.lock();
        s.history.clear();
        s.floor = s.rv;
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.lock().rv
    }

    /// An object as stored (namespace empty for cluster-scoped).
    pub fn get(&self, res: &Res, namespace: &str, name: &str) -> Option<Value> {
        let key = Key {
            res: res.clone(),
            namespace: namespace.into(),
            name: name.into(),
        };
        self.shared.lock().objects.get(&key).cloned()
    }

    /// Requests served so far, as `METHOD path?query`.
    pub fn requests(&self) -> Vec<String> {
        self.shared.lock().requests.clone()
    }

    /// A kube client whose requests the double attributes to `user` (see [`Self::requests_of`]),
    /// so a test can tell the operator's requests from its own.
    pub fn client_as(&self, user: &str) -> kube::Client {
        let mut config = kube::Config::new(self.url().parse().expect("the double's URL"));
        config.headers.push((
            header::HeaderName::from_static(USER_HEADER),
            header::HeaderValue::from_str(user).expect("a header value"),
        ));
        kube::Client::try_from(config).expect("a kube client for the double")
    }

    /// The requests made by clients from [`Self::client_as`]`(user)`, as in [`Self::requests`].
    pub fn requests_of(&self, user: &str) -> Vec<String> {
        let s = self.shared.lock();
        s.requests_by
            .iter()
            .filter(|(u, _)| u == user)
            .map(|(_, r)| r.clone())
            .collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Errors

struct ApiError {
    code: StatusCode,
    reason: &'static str,
    message: String,
    details: Option<Value>,
}

impl ApiError {
    fn new(code: StatusCode, reason: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }

    fn about(mut self, key: &Key) -> ApiError {
        self.details =
            Some(json!({"name": key.name, "group": key.res.group, "kind": key.res.plural}));
        self
    }

    fn status(&self) -> Value {
        let mut v = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code.as_u16(),
        });
        if let Some(d) = &self.details {
            v["details"] = d.clone();
        }
        v
    }

    fn not_found(key: &Key) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!(
                "{}.{} \"{}\" not found",
                key.res.plural, key.res.group, key.name
            ),
        )
        .about(key)
    }

    fn conflict(key: &Key, why: &str) -> ApiError {
        ApiError::new(
            StatusCode::CONFLICT,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {}.{} \"{}\": {why}",
                key.res.plural, key.res.group, key.name
            ),
        )
        .about(key)
    }

    fn invalid(key: &Key, why: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", why).about(key)
    }

    fn bad_request(why: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "BadRequest", why)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        json_response(self.code, &self.status())
    }
}

fn json_response(code: StatusCode, v: &Value) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        serde_json::to_vec(v).unwrap_or_default(),
    )
        .into_response()
}

// ---------------------------------------------------------------------------------------------
// Routing

/// What a path names.
struct Target {
    res: Res,
    /// `None` for all namespaces or a cluster-scoped resource.
    namespace: Option<String>,
    name: Option<String>,
    sub: Option<String>,
}

impl Target {
    fn key(&self, name: &str) -> Key {
        Key {
            res: self.res.clone(),
            namespace: self.namespace.clone().unwrap_or_default(),
            name: name.into(),
        }
    }
}

fn parse_path(path: &str) -> Option<Target> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, mut rest) = match *segs.first()? {
        "api" => ("", *segs.get(1)?, segs.get(2..)?),
        "apis" => (*segs.get(1)?, *segs.get(2)?, segs.get(3..)?),
        _ => return None,
    };
    let mut namespace = None;
    if rest.len() >= 3 && rest[0] == "namespaces" {
        namespace = Some(rest[1].to_owned());
        rest = &rest[2..];
    }
    if rest.is_empty() || rest.len() > 3 {
        return None;
    }
    Some(Target {
        res: Res::new(group, version, rest[0]),
        namespace,
        name: rest.get(1).map(|s| s.to_string()),
        sub: rest.get(2).map(|s| s.to_string()),
    })
}

type Query = BTreeMap<String, String>;

async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let query: Query = uri
        .query()
        .map(|q| {
            url::form_urlencoded::parse(q.as_bytes())
                .into_owned()
                .collect()
        })
        .unwrap_or_default();
    {
        let line = format!(
            "{method} {}{}",
            uri.path(),
            uri.query().map(|q| format!("?{q}")).unwrap_or_default()
        );
        let user = headers
            .get(USER_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let mut s = shared.lock();
        s.requests.push(line.clone());
        s.requests_by.push((user, line));
    }
    let user = headers
        .get(USER_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let not_found = || {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            "the server could not find the requested resource",
        )
        .into_response()
    };
    let Some(t) = parse_path(uri.path()) else {
        return not_found();
    };
    if shared
        .lock()
        .uninstalled
        .contains(&(t.res.group.clone(), t.res.plural.clone()))
    {
        return not_found();
    }
    let result = match (&method, &t.name, t.sub.as_deref()) {
        (&Method::GET, None, _) if is_true(query.get("watch")) => {
            return watch(&shared, &t, &query);
        }
        (&Method::GET, None, _) => list(&shared, &t, &query),
        (&Method::POST, None, _) => create(&shared, &t, &body, &user),
        (&Method::GET, Some(name), None | Some("status")) => get(&shared, &t.key(name)),
        (&Method::PUT, Some(name), sub @ (None | Some("status"))) => parse_body(&body)
            .and_then(|b| write(&shared, &t.key(name), sub.is_some(), &user, |_| Ok(b))),
        (&Method::PATCH, Some(name), sub @ (None | Some("status"))) => {
            let ctype = headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned();
            patch(&shared, &t.key(name), sub.is_some(), &user, &ctype, &body)
        }
        (&Method::DELETE, Some(name), None) => delete(&shared, &t.key(name), &body),
        _ => Err(ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!("{method} is not supported on {}", uri.path()),
        )),
    };
    match result {
        Ok((code, v)) => json_response(code, &v),
        Err(e) => e.into_response(),
    }
}

fn is_true(v: Option<&String>) -> bool {
    matches!(v.map(String::as_str), Some("true" | "1"))
}

fn parse_body(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("body: {e}")))
}

type Answer = Result<(StatusCode, Value), ApiError>;

// ---------------------------------------------------------------------------------------------
// Selectors

#[derive(Debug)]
enum Req {
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

#[derive(Debug, Default)]
struct Selector {
    labels: Vec<Req>,
    fields: Vec<Req>,
}

/// Splits on commas outside parentheses.
fn split_terms(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0;
    let mut cur = String::new();
    for c in s.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    out.push(cur);
    out.into_iter()
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty())
        .collect()
}

fn parse_req(term: &str) -> Result<Req, ApiError> {
    let bad = || ApiError::bad_request(format!("unable to parse requirement: {term:?}"));
    let set = |rest: &str| -> Result<Vec<String>, ApiError> {
        let inner = rest
            .trim()
            .strip_prefix('(')
            .and_then(|r| r.strip_suffix(')'))
            .ok_or_else(bad)?;
        Ok(inner.split(',').map(|v| v.trim().to_owned()).collect())
    };
    if let Some(k) = term.strip_prefix('!') {
        return Ok(Req::NotExists(k.trim().to_owned()));
    }
    if let Some((k, v)) = term.split_once("!=") {
        return Ok(Req::Ne(k.trim().into(), v.trim().into()));
    }
    if let Some((k, v)) = term.split_once("==") {
        return Ok(Req::Eq(k.trim().into(), v.trim().into()));
    }
    if let Some((k, v)) = term.split_once('=') {
        return Ok(Req::Eq(k.trim().into(), v.trim().into()));
    }
    if let Some((k, rest)) = term.split_once(" notin ") {
        return Ok(Req::NotIn(k.trim().into(), set(rest)?));
    }
    if let Some((k, rest)) = term.split_once(" in ") {
        return Ok(Req::In(k.trim().into(), set(rest)?));
    }
    if term.contains(' ') || term.contains('(') {
        return Err(bad());
    }
    Ok(Req::Exists(term.to_owned()))
}

impl Selector {
    fn from_query(q: &Query) -> Result<Selector, ApiError> {
        let mut sel = Selector::default();
        if let Some(l) = q.get("labelSelector") {
            for t in split_terms(l) {
                sel.labels.push(parse_req(&t)?);
            }
        }
        if let Some(f) = q.get("fieldSelector") {
            for t in split_terms(f) {
                let r = parse_req(&t)?;
                match &r {
                    Req::Eq(k, _) | Req::Ne(k, _)
                        if k == "metadata.name" || k == "metadata.namespace" => {}
                    _ => {
                        return Err(ApiError::bad_request(format!(
                            "field label not supported: {t}"
                        )));
                    }
                }
                sel.fields.push(r);
            }
        }
        Ok(sel)
    }

    fn matches(&self, obj: &Value) -> bool {
        let label = |k: &str| {
            obj.pointer("/metadata/labels")
                .and_then(|l| l.get(k))
                .and_then(Value::as_str)
                .map(String::from)
        };
        let field = |k: &str| match k {
            "metadata.name" => obj
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .map(String::from),
            _ => Some(
                obj.pointer("/metadata/namespace")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned(),
            ),
        };
        self.labels.iter().all(|r| r.check(&label)) && self.fields.iter().all(|r| r.check(&field))
    }
}

impl Req {
    fn check(&self, get: &dyn Fn(&str) -> Option<String>) -> bool {
        match self {
            Req::Eq(k, v) => get(k).as_ref() == Some(v),
            Req::Ne(k, v) => get(k).as_ref() != Some(v),
            Req::In(k, vs) => get(k).is_some_and(|x| vs.contains(&x)),
            Req::NotIn(k, vs) => !get(k).is_some_and(|x| vs.contains(&x)),
            Req::Exists(k) => get(k).is_some(),
            Req::NotExists(k) => get(k).is_none(),
        }
    }
}

fn in_scope(t: &Target, key: &Key) -> bool {
    key.res == t.res && t.namespace.as_ref().is_none_or(|ns| *ns == key.namespace)
}

// ---------------------------------------------------------------------------------------------
// Reads

fn get(shared: &Shared, key: &Key) -> Answer {
    let s = shared.lock();
    let obj = s.objects.get(key).ok_or_else(|| ApiError::not_found(key))?;
    Ok((StatusCode::OK, obj.clone()))
}

fn list(shared: &Shared, t: &Target, q: &Query) -> Answer {
    let sel = Selector::from_query(q)?;
    let s = shared.lock();
    let items: Vec<Value> = s
        .objects
        .iter()
        .filter(|(k, v)| in_scope(t, k) && sel.matches(v))
        .map(|(_, v)| v.clone())
        .collect();
    let kind = items
        .first()
        .and_then(|i| i.get("kind"))
        .and_then(Value::as_str)
        .map(|k| format!("{k}List"))
        .unwrap_or_else(|| "List".into());
    Ok((
        StatusCode::OK,
        json!({
            "apiVersion": t.res.api_version(),
            "kind": kind,
            "metadata": {"resourceVersion": s.rv.to_string()},
            "items": items,
        }),
    ))
}

/// The event a watcher with `sel` sees for `c`, if any.
fn event_for(c: &Change, sel: &Selector) -> Option<Value> {
    let was = c.old.as_ref().is_some_and(|o| sel.matches(o));
    let is = c.new.as_ref().is_some_and(|n| sel.matches(n));
    let (kind, obj) = match (was, is) {
        (false, true) => ("ADDED", c.new.as_ref()?),
        (true, true) => ("MODIFIED", c.new.as_ref()?),
        (true, false) => ("DELETED", c.new.as_ref().unwrap_or(&c.last)),
        (false, false) => return None,
    };
    Some(json!({"type": kind, "object": obj}))
}

fn watch(shared: &Arc<Shared>, t: &Target, q: &Query) -> Response {
    let sel = match Selector::from_query(q) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|s| s.parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or(Duration::from_secs(1800));
    // Subscribing under the lock leaves no gap between the replay and the live events; events
    // already replayed are skipped by version.
    let (initial, high, rx) = {
        let s = shared.lock();
        let rx = shared.events.subscribe();
        let mut initial = Vec::new();
        match q.get("resourceVersion").map(String::as_str) {
            None | Some("") | Some("0") => {
                for (k, v) in &s.objects {
                    if in_scope(t, k) && sel.matches(v) {
                        initial.push(json!({"type": "ADDED", "object": v}));
                    }
                }
            }
            Some(rv) => {
                let Ok(from) = rv.parse::<u64>() else {
                    return ApiError::bad_request(format!("invalid resourceVersion {rv:?}"))
                        .into_response();
                };
                if from < s.floor {
                    let gone = ApiError::new(
                        StatusCode::GONE,
                        "Expired",
                        format!("too old resource version: {from} ({})", s.floor),
                    );
                    initial.push(json!({"type": "ERROR", "object": gone.status()}));
                    let body = lines(initial);
                    return (StatusCode::OK, body).into_response();
                }
                for c in s
                    .history
                    .iter()
                    .filter(|c| c.rv > from && in_scope(t, &c.key))
                {
                    initial.extend(event_for(c, &sel));
                }
            }
        }
        (initial, s.rv, rx)
    };
    let target = Target {
        res: t.res.clone(),
        namespace: t.namespace.clone(),
        name: None,
        sub: None,
    };
    let live =
        futures::stream::unfold((rx, sel, target), move |(mut rx, sel, target)| async move {
            loop {
                match rx.recv().await {
                    Ok(c) => {
                        if c.rv <= high || !in_scope(&target, &c.key) {
                            continue;
                        }
                        if let Some(ev) = event_for(&c, &sel) {
                            return Some((ev, (rx, sel, target)));
                        }
                    }
                    // A watcher that fell behind is closed; the client watches again from its
                    // last version, as with a real server.
                    Err(_) => return None,
                }
            }
        });
    use futures::StreamExt as _;
    let stream = futures::stream::iter(initial)
        .chain(live)
        .map(|ev| {
            let mut line = serde_json::to_vec(&ev).unwrap_or_default();
            line.push(b'\n');
            Ok::<_, Infallible>(Bytes::from(line))
        })
        .take_until(tokio::time::sleep(timeout))
        .take_until(shared.stopped.clone().cancelled_owned());
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

fn lines(events: Vec<Value>) -> Body {
    let mut out = Vec::new();
    for e in events {
        out.extend(serde_json::to_vec(&e).unwrap_or_default());
        out.push(b'\n');
    }
    Body::from(out)
}

// ---------------------------------------------------------------------------------------------
// Writes

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

fn meta(v: &Value, field: &str) -> Option<Value> {
    v.get("metadata").and_then(|m| m.get(field)).cloned()
}

fn meta_mut(v: &mut Value) -> &mut Map<String, Value> {
    if !v.get("metadata").is_some_and(Value::is_object) {
        v["metadata"] = json!({});
    }
    v["metadata"]
        .as_object_mut()
        .expect("metadata is an object")
}

fn finalizers(v: &Value) -> Vec<String> {
    v.pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|f| f.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// The garbage collector's finalizers.
const ORPHAN: &str = "orphan";
const FOREGROUND: &str = "foregroundDeletion";

fn owner_refs(v: &Value) -> Vec<Value> {
    v.pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

fn uid_of(v: &Value) -> String {
    v.pointer("/metadata/uid")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

fn rv_of(v: &Value) -> Option<String> {
    meta(v, "resourceVersion")
        .and_then(|r| r.as_str().map(String::from))
        .filter(|r| !r.is_empty())
}

/// Everything but metadata and status: what `generation` counts.
fn spec_part(v: &Value) -> Value {
    let mut v = v.clone();
    if let Some(o) = v.as_object_mut() {
        o.remove("metadata");
        o.remove("status");
    }
    v
}

impl Store {
    /// Records a change: bumps the version, stores or removes the object, keeps the history
    /// and tells the watchers. Returns the object as stored (or as it was last).
    fn commit(
        &mut self,
        shared_tx: &broadcast::Sender<Arc<Change>>,
        key: &Key,
        new: Option<Value>,
    ) -> Value {
        self.rv += 1;
        let rv = self.rv.to_string();
        let old = self.objects.get(key).cloned();
        let (new, last) = match new {
            Some(mut n) => {
                meta_mut(&mut n).insert("resourceVersion".into(), rv.into());
                self.objects.insert(key.clone(), n.clone());
                (Some(n.clone()), n)
            }
            None => {
                let mut last = self.objects.remove(key).unwrap_or(Value::Null);
                meta_mut(&mut last).insert("resourceVersion".into(), rv.into());
                (None, last)
            }
        };
        let change = Arc::new(Change {
            rv: self.rv,
            key: key.clone(),
            old,
            new,
            last: last.clone(),
        });
        self.history.push(Arc::clone(&change));
        let _ = shared_tx.send(change);
        last
    }

    /// Stores `new` over an existing object; a deleting object whose last finalizer went is
    /// removed.
    fn store(&mut self, tx: &broadcast::Sender<Arc<Change>>, key: &Key, new: Value) -> Value {
        let deleting = meta(&new, "deletionTimestamp").is_some();
        if deleting && finalizers(&new).is_empty() {
            let stored = self.commit(tx, key, Some(new));
            self.commit(tx, key, None);
            return stored;
        }
        self.commit(tx, key, Some(new))
    }

    /// Deletes `obj` (the object at `key`, finalizers as they should be): removed when it has
    /// none, else marked with a `deletionTimestamp`.
    fn delete_object(
        &mut self,
        tx: &broadcast::Sender<Arc<Change>>,
        key: &Key,
        obj: Value,
    ) -> Value {
        if finalizers(&obj).is_empty() {
            return self.commit(tx, key, None);
        }
        let mut marked = obj;
        let m = meta_mut(&mut marked);
        m.insert("deletionTimestamp".into(), now().into());
        m.insert("deletionGracePeriodSeconds".into(), 0.into());
        self.commit(tx, key, Some(marked))
    }

    /// `OwnerReferencesPermissionEnforcement` on a write of `new` over `old` (`None`: a create)
    /// by `user`.
    fn check_owner_references(
        &self,
        user: &str,
        key: &Key,
        old: Option<&Value>,
        new: &Value,
    ) -> Result<(), ApiError> {
        let Some(e) = &self.owner_enforcement else {
            return Ok(());
        };
        let Some((sa_ns, sa)) = e.users.get(user) else {
            return Ok(());
        };
        let before = old.map(owner_refs).unwrap_or_default();
        let after = owner_refs(new);
        if before == after {
            return Ok(());
        }
        let allows = |verb: &str, group: &str, resource: String, name: &str| {
            e.policy.allows(
                (sa_ns, sa),
                &super::rbac::Attributes {
                    verb: verb.into(),
                    group: group.into(),
                    resource,
                    namespace: key.namespace.clone(),
                    name: name.into(),
                },
            )
        };
        let forbidden = |why: String| {
            ApiError::new(
                StatusCode::FORBIDDEN,
                "Forbidden",
                format!(
                    "{}.{} \"{}\" is forbidden: {why}",
                    key.res.plural, key.res.group, key.name
                ),
            )
            .about(key)
        };
        // A create may set any owner reference: its author could have not created it.
        if old.is_some() && !allows("delete", &key.res.group, key.res.plural.clone(), &key.name) {
            return Err(forbidden(
                "cannot set an ownerRef on a resource you can't delete".into(),
            ));
        }
        let blocking = |r: &Value| r["blockOwnerDeletion"] == true;
        for r in after.iter().filter(|r| blocking(r)) {
            if before.iter().any(|b| b["uid"] == r["uid"] && blocking(b)) {
                continue;
            }
            let api_version = r["apiVersion"].as_str().unwrap_or_default();
            let group = api_version.rsplit_once('/').map_or("", |(g, _)| g);
            let kind = r["kind"].as_str().unwrap_or_default().to_lowercase();
            let name = r["name"].as_str().unwrap_or_default();
            if !allows("update", group, format!("{kind}s/finalizers"), name) {
                return Err(forbidden(format!(
                    "cannot set blockOwnerDeletion if an ownerReference refers to a resource you can't set finalizers on: User \"system:serviceaccount:{sa_ns}:{sa}\" cannot update resource \"{kind}s/finalizers\" in API group \"{group}\""
                )));
            }
        }
        Ok(())
    }

    /// The garbage collector, to a fixed point (when it is on).
    fn collect(&mut self, tx: &broadcast::Sender<Arc<Change>>) {
        if !self.gc {
            return;
        }
        loop {
            let mut changed = false;
            let keys: Vec<Key> = self.objects.keys().cloned().collect();
            for k in &keys {
                let Some(owner) = self.objects.get(k).cloned() else {
                    continue;
                };
                if meta(&owner, "deletionTimestamp").is_none() {
                    continue;
                }
                let fs = finalizers(&owner);
                let policy = if fs.iter().any(|f| f == ORPHAN) {
                    ORPHAN
                } else if fs.iter().any(|f| f == FOREGROUND) {
                    FOREGROUND
                } else {
                    continue;
                };
                let uid = uid_of(&owner);
                let dependents: Vec<Key> = self
                    .objects
                    .iter()
                    .filter(|(dk, d)| {
                        (k.namespace.is_empty() || dk.namespace == k.namespace)
                            && owner_refs(d).iter().any(|r| r["uid"] == uid.as_str())
                    })
                    .map(|(dk, _)| dk.clone())
                    .collect();
                for dk in &dependents {
                    let d = self.objects[dk].clone();
                    let others_live = owner_refs(&d).iter().any(|r| {
                        r["uid"] != uid.as_str()
                            && self.live_owner(r["uid"].as_str().unwrap_or_default())
                    });
                    if policy == ORPHAN || others_live {
                        self.drop_owner(tx, dk, &uid);
                    } else if meta(&d, "deletionTimestamp").is_none() {
                        self.collected
                            .push((dk.res.plural.clone(), dk.name.clone()));
                        self.delete_object(tx, dk, d);
                    }
                }
                // Foreground: the owner waits for its blocking dependents to be gone.
                let blocked = policy == FOREGROUND
                    && self.objects.values().any(|d| {
                        owner_refs(d)
                            .iter()
                            .any(|r| r["uid"] == uid.as_str() && r["blockOwnerDeletion"] == true)
                    });
                if !blocked {
                    let mut o = self.objects[k].clone();
                    let rest: Vec<String> = fs.into_iter().filter(|f| f != policy).collect();
                    meta_mut(&mut o).insert("finalizers".into(), json!(rest));
                    self.store(tx, k, o);
                    changed = true;
                }
            }
            // Background: an object whose owners are all gone goes too.
            let keys: Vec<Key> = self.objects.keys().cloned().collect();
            for k in &keys {
                let d = self.objects[k].clone();
                let refs = owner_refs(&d);
                if refs.is_empty() || meta(&d, "deletionTimestamp").is_some() {
                    continue;
                }
                let all_gone = refs.iter().all(|r| {
                    let u = r["uid"].as_str().unwrap_or_default();
                    !self.objects.values().any(|o| uid_of(o) == u)
                });
                if all_gone {
                    self.collected.push((k.res.plural.clone(), k.name.clone()));
                    self.delete_object(tx, k, d);
                    changed = true;
                }
            }
            if !changed {
                return;
            }
        }
    }

    /// Whether an object with `uid` exists and is not being deleted in the foreground.
    fn live_owner(&self, uid: &str) -> bool {
        self.objects.values().any(|o| {
            uid_of(o) == uid
                && !(meta(o, "deletionTimestamp").is_some()
                    && finalizers(o).iter().any(|f| f == FOREGROUND))
        })
    }

    /// Takes the references to `uid` off the object at `key`.
    fn drop_owner(&mut self, tx: &broadcast::Sender<Arc<Change>>, key: &Key, uid: &str) {
        let mut d = self.objects[key].clone();
        let rest: Vec<Value> = owner_refs(&d)
            .into_iter()
            .filter(|r| r["uid"] != uid)
            .collect();
        meta_mut(&mut d).insert("ownerReferences".into(), json!(rest));
        self.commit(tx, key, Some(d));
    }

    fn has_status(&self, res: &Res) -> bool {
        self.status_subresources
            .contains(&(res.group.clone(), res.plural.clone()))
    }
}

fn create(shared: &Shared, t: &Target, body: &[u8], user: &str) -> Answer {
    let mut obj = parse_body(body)?;
    let mut s = shared.lock();
    let ns = t.namespace.clone().unwrap_or_default();
    if let Some(body_ns) = meta(&obj, "namespace").and_then(|v| v.as_str().map(String::from))
        && !ns.is_empty()
        && body_ns != ns
    {
        return Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    let name = match meta(&obj, "name").and_then(|v| v.as_str().map(String::from)) {
        Some(n) if !n.is_empty() => n,
        _ => match meta(&obj, "generateName").and_then(|v| v.as_str().map(String::from)) {
            Some(prefix) => {
                s.uid += 1;
                format!("{prefix}{:05x}", s.uid)
            }
            None => {
                return Err(ApiError::invalid(
                    &t.key(""),
                    "metadata.name: Required value: name or generateName is required",
                ));
            }
        },
    };
    let key = t.key(&name);
    if rv_of(&obj).is_some() {
        return Err(ApiError::invalid(
            &key,
            "metadata.resourceVersion: Invalid value: must not be set on objects to be created",
        ));
    }
    if s.objects.contains_key(&key) {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "AlreadyExists",
            format!(
                "{}.{} \"{name}\" already exists",
                key.res.plural, key.res.group
            ),
        )
        .about(&key));
    }
    if s.has_status(&key.res)
        && let Some(o) = obj.as_object_mut()
    {
        o.remove("status");
    }
    s.check_owner_references(user, &key, None, &obj)?;
    s.uid += 1;
    let uid = format!("00000000-0000-0000-0000-{:012x}", s.uid);
    let m = meta_mut(&mut obj);
    m.insert("name".into(), name.into());
    if !ns.is_empty() {
        m.insert("namespace".into(), ns.into());
    }
    m.insert("uid".into(), uid.into());
    m.insert("creationTimestamp".into(), now().into());
    m.insert("generation".into(), 1.into());
    m.remove("deletionTimestamp");
    m.remove("deletionGracePeriodSeconds");
    let tx = shared.events.clone();
    let stored = s.commit(&tx, &key, Some(obj));
    s.collect(&tx);
    Ok((StatusCode::CREATED, stored))
}

/// A write to an existing object: `build` turns the stored object into the requested one (a
/// PUT body, or the stored object patched); the server's rules then decide what is stored.
fn write(
    shared: &Shared,
    key: &Key,
    status_only: bool,
    user: &str,
    build: impl FnOnce(&Value) -> Result<Value, ApiError>,
) -> Answer {
    let mut s = shared.lock();
    let tx = shared.events.clone();
    if !s.objects.contains_key(key) {
        return Err(ApiError::not_found(key));
    }
    if s.inject_conflicts
        && (s.conflicts_only_on.is_empty() || s.conflicts_only_on.contains(&key.res.plural))
        && s.conflicted.insert(key.clone())
    {
        let mut touched = s.objects[key].clone();
        let n = s.rv + 1;
        meta_mut(&mut touched)
            .entry("annotations")
            .or_insert_with(|| json!({}))["apiserver-double/concurrent-write"] =
            n.to_string().into();
        s.commit(&tx, key, Some(touched));
    }
    let existing = s.objects[key].clone();
    let requested = build(&existing)?;
    if let Some(rv) = rv_of(&requested)
        && Some(&rv) != rv_of(&existing).as_ref()
    {
        return Err(ApiError::conflict(
            key,
            "the object has been modified; please apply your changes to the latest version and try again",
        ));
    }
    if meta(&requested, "name")
        .and_then(|n| n.as_str().map(String::from))
        .as_deref()
        != Some(key.name.as_str())
    {
        return Err(ApiError::bad_request(
            "the name of the object does not match the name on the URL",
        ));
    }
    let has_status = s.has_status(&key.res);
    let mut new = if status_only {
        let mut n = existing.clone();
        match requested.get("status") {
            Some(st) => n["status"] = st.clone(),
            None => {
                if let Some(o) = n.as_object_mut() {
                    o.remove("status");
                }
            }
        }
        n
    } else {
        let mut n = requested;
        if has_status && let Some(o) = n.as_object_mut() {
            match existing.get("status") {
                Some(st) => {
                    o.insert("status".into(), st.clone());
                }
                None => {
                    o.remove("status");
                }
            }
        }
        // System fields are the server's.
        let m = meta_mut(&mut n);
        for f in [
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "namespace",
            "resourceVersion",
        ] {
            match meta(&existing, f) {
                Some(v) => m.insert(f.into(), v),
                None => m.remove(f),
            };
        }
        n
    };
    let deleting = meta(&existing, "deletionTimestamp").is_some();
    if deleting {
        let before = finalizers(&existing);
        if let Some(f) = finalizers(&new).into_iter().find(|f| !before.contains(f)) {
            return Err(ApiError::invalid(
                key,
                format!(
                    "metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers [\"{f}\"]"
                ),
            ));
        }
    }
    if new == existing {
        return Ok((StatusCode::OK, existing));
    }
    s.check_owner_references(user, key, Some(&existing), &new)?;
    if spec_part(&new) != spec_part(&existing) {
        let g = meta(&existing, "generation")
            .and_then(|g| g.as_i64())
            .unwrap_or(0);
        meta_mut(&mut new).insert("generation".into(), (g + 1).into());
    }
    let stored = s.store(&tx, key, new);
    s.collect(&tx);
    Ok((StatusCode::OK, stored))
}

fn patch(
    shared: &Shared,
    key: &Key,
    status_only: bool,
    user: &str,
    ctype: &str,
    body: &[u8],
) -> Answer {
    let ctype = ctype.split(';').next().unwrap_or("").trim();
    let p = parse_body(body)?;
    match ctype {
        "application/merge-patch+json" => write(shared, key, status_only, user, |existing| {
            let mut v = existing.clone();
            merge_patch(&mut v, &p);
            Ok(v)
        }),
        "application/json-patch+json" => write(shared, key, status_only, user, |existing| {
            let mut v = existing.clone();
            json_patch(&mut v, &p).map_err(|why| ApiError::invalid(key, why))?;
            Ok(v)
        }),
        // Server-side apply, as one field manager that applies its whole state every time
        // sees it: the applied object merged in (see the module's "does NOT check").
        "application/apply-patch+yaml" => write(shared, key, status_only, user, |existing| {
            let mut v = existing.clone();
            let mut applied = p.clone();
            if let Some(m) = applied.as_object_mut() {
                m.remove("apiVersion");
                m.remove("kind");
            }
            merge_patch(&mut v, &applied);
            Ok(v)
        }),
        other => Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            format!("the double does not serve patches of type {other:?}"),
        )),
    }
}

fn delete(shared: &Shared, key: &Key, body: &[u8]) -> Answer {
    let opts: Value = if body.is_empty() {
        json!({})
    } else {
        parse_body(body)?
    };
    let mut s = shared.lock();
    let tx = shared.events.clone();
    let existing = s
        .objects
        .get(key)
        .cloned()
        .ok_or_else(|| ApiError::not_found(key))?;
    if let Some(rv) = opts
        .pointer("/preconditions/resourceVersion")
        .and_then(Value::as_str)
        && Some(rv) != rv_of(&existing).as_deref()
    {
        return Err(ApiError::conflict(
            key,
            "the ResourceVersion in the precondition does not match the ResourceVersion in record",
        ));
    }
    if let Some(uid) = opts.pointer("/preconditions/uid").and_then(Value::as_str)
        && Some(uid) != meta(&existing, "uid").as_ref().and_then(Value::as_str)
    {
        return Err(ApiError::conflict(
            key,
            "the UID in the precondition does not match the UID in record",
        ));
    }
    if meta(&existing, "deletionTimestamp").is_some() {
        return Ok((StatusCode::OK, existing));
    }
    let mut marked = existing;
    let gc_finalizer = match opts.get("propagationPolicy").and_then(Value::as_str) {
        Some("Orphan") => Some(ORPHAN),
        Some("Foreground") => Some(FOREGROUND),
        _ => None,
    };
    if let Some(f) = gc_finalizer {
        let mut fs = finalizers(&marked);
        if !fs.iter().any(|x| x == f) {
            fs.push(f.into());
        }
        meta_mut(&mut marked).insert("finalizers".into(), json!(fs));
    }
    let stored = s.delete_object(&tx, key, marked);
    s.collect(&tx);
    Ok((StatusCode::OK, stored))
}

/// RFC 7386.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Some(p) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let t = target.as_object_mut().expect("an object");
    for (k, v) in p {
        if v.is_null() {
            t.remove(k);
        } else {
            merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

/// RFC 6902's `add`, `remove`, `replace` and `test`.
fn json_patch(doc: &mut Value, ops: &Value) -> Result<(), String> {
    let ops = ops.as_array().ok_or("a JSON patch is an array")?;
    for op in ops {
        let kind = op.get("op").and_then(Value::as_str).ok_or("op missing")?;
        let path = op
            .get("path")
            .and_then(Value::as_str)
            .ok_or("path missing")?;
        let value = op.get("value");
        let tokens: Vec<String> = if path.is_empty() {
            vec![]
        } else {
            path.strip_prefix('/')
                .ok_or_else(|| format!("invalid path {path:?}"))?
                .split('/')
                .map(|t| t.replace("~1", "/").replace("~0", "~"))
                .collect()
        };
        let Some((last, parents)) = tokens.split_last() else {
            return Err("operations on the whole document are not supported".into());
        };
        let mut parent = &mut *doc;
        for t in parents {
            parent = match parent {
                Value::Object(o) => o.get_mut(t),
                Value::Array(a) => t.parse::<usize>().ok().and_then(|i| a.get_mut(i)),
                _ => None,
            }
            .ok_or_else(|| format!("path {path:?} does not exist"))?;
        }
        let missing = || format!("path {path:?} does not exist");
        match (kind, parent) {
            ("test", p) => {
                let actual = match p {
                    Value::Object(o) => o.get(last),
                    Value::Array(a) => last.parse::<usize>().ok().and_then(|i| a.get(i)),
                    _ => None,
                };
                if actual != value {
                    return Err(format!("testing value {path:?} failed"));
                }
            }
            ("add", Value::Object(o)) | ("replace", Value::Object(o)) => {
                if kind == "replace" && !o.contains_key(last) {
                    return Err(missing());
                }
                o.insert(last.clone(), value.ok_or("value missing")?.clone());
            }
            ("add", Value::Array(a)) => {
                let v = value.ok_or("value missing")?.clone();
                if last == "-" {
                    a.push(v);
                } else {
                    let i: usize = last.parse().map_err(|_| missing())?;
                    if i > a.len() {
                        return Err(missing());
                    }
                    a.insert(i, v);
                }
            }
            ("replace", Value::Array(a)) => {
                let i: usize = last.parse().map_err(|_| missing())?;
                *a.get_mut(i).ok_or_else(missing)? = value.ok_or("value missing")?.clone();
            }
            ("remove", Value::Object(o)) => {
                o.remove(last).ok_or_else(missing)?;
            }
            ("remove", Value::Array(a)) => {
                let i: usize = last.parse().map_err(|_| missing())?;
                if i >= a.len() {
                    return Err(missing());
                }
                a.remove(i);
            }
            (k @ ("add" | "replace" | "remove"), _) => return Err(format!("{k}: {}", missing())),
            (k, _) => return Err(format!("op {k:?} is not supported by the double")),
        }
    }
    Ok(())
}
