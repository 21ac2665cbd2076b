//! Running under etcd-druid in place of etcd-backup-restore (`[druid]`, set by `etcdbrctl
//! server`): the endpoints etcd-wrapper calls before it starts etcd.
//!
//! etcd-wrapper (the pod's etcd container) polls `GET /initialization/status`; while it reads
//! `New` it asks `GET /initialization/start?mode=full|sanity`; once it reads `Successful` it
//! fetches `GET /config` and starts etcd with it. It has no timeout: a body it does not know
//! (`Progress`, `Failed`) means "still running". etcd-backup-restore answers a read of
//! `Successful` or `Failed` once and then `New` again ([`Status::read`]), so a failure is
//! retried by the wrapper's next `start`, and a success read twice (a lost answer) runs the
//! initialization again: it must be safe to repeat, and it is — a valid data directory is kept.
//!
//! The initialization is etcd-warden's own (`restore.initialize`): a lost member of a running
//! cluster rejoins it as a learner ([`crate::restore::rejoin`], with `restore.cluster_endpoints`
//! = `--service-endpoints`), otherwise the data directory is validated in the mode the wrapper
//! asks for and restored from the store when missing, corrupt or behind. It restores the member
//! with its own name, peer URLs and cluster from etcd's configuration file
//! ([`etcd_config::member`]), not etcd-backup-restore's `default`/`http://localhost:2380`, so no
//! peer URL has to be repaired (and etcd restarted through the wrapper) afterwards.

pub mod etcd_config;
pub mod forward;
pub mod lease;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::config::{DruidConfig, RestoreConfig, Validation};
use crate::restore::initialize::InitializeMetrics;
use crate::store::SnapshotStore;
use etcd_config::{EtcdConfigError, Listed};

/// `/initialization/status`'s values, as etcd-backup-restore spells them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    New,
    Progress,
    Successful,
    Failed,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::New => "New",
            Status::Progress => "Progress",
            Status::Successful => "Successful",
            Status::Failed => "Failed",
        }
    }

    /// `start`: from `New` only, to `Progress`; `true` when an initialization is to run.
    pub fn start(&mut self) -> bool {
        if *self == Status::New {
            *self = Status::Progress;
            true
        } else {
            false
        }
    }

    /// A read: the status, and an outcome (`Successful`, `Failed`) is consumed.
    pub fn read(&mut self) -> Status {
        let now = *self;
        if matches!(now, Status::Successful | Status::Failed) {
            *self = Status::New;
        }
        now
    }

    /// The initialization ended.
    pub fn finish(&mut self, ok: bool) {
        *self = if ok {
            Status::Successful
        } else {
            Status::Failed
        };
    }
}

/// What the initialization endpoints need.
#[derive(Clone)]
pub struct Druid {
    config: DruidConfig,
    /// `config.pod_name`, required by `serve` with `[druid]`.
    pod_name: String,
    restore: RestoreConfig,
    store: SnapshotStore,
    /// `[store.secondary]`: read when the primary cannot be listed or is empty.
    secondary: Option<SnapshotStore>,
    metrics: InitializeMetrics,
    status: Arc<Mutex<Status>>,
    cancel: CancellationToken,
}

impl Druid {
    pub fn new(
        config: DruidConfig,
        restore: RestoreConfig,
        store: SnapshotStore,
        secondary: Option<SnapshotStore>,
        metrics: InitializeMetrics,
        cancel: CancellationToken,
    ) -> Self {
        Druid {
            pod_name: config.pod_name.clone().unwrap_or_default(),
            config,
            restore,
            store,
            secondary,
            metrics,
            status: Arc::new(Mutex::new(Status::New)),
            cancel,
        }
    }

    fn status(&self) -> std::sync::MutexGuard<'_, Status> {
        self.status.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// etcd's configuration file, read now (druid updates the ConfigMap in place).
    fn etcd_config(&self) -> Result<String, String> {
        std::fs::read_to_string(&self.config.etcd_config)
            .map_err(|e| format!("cannot read {}: {e}", self.config.etcd_config.display()))
    }

    /// The restore section with this member's name, peer URLs and cluster from etcd's
    /// configuration file, and the wrapper's validation mode.
    fn restore_config(&self, mode: Validation) -> Result<RestoreConfig, String> {
        let text = self.etcd_config()?;
        let me = etcd_config::member(&text, &self.pod_name).map_err(|e| e.to_string())?;
        let mut r = self.restore.clone();
        r.name = me.name;
        r.initial_advertise_peer_urls = me.peer_urls;
        r.initial_cluster = me.initial_cluster;
        r.initial_cluster_token = me.initial_cluster_token;
        r.validation = mode;
        // The file is what etcd runs with: its peer certificate, else the restore section's.
        if me.peer_tls.is_some() {
            r.peer_tls = me.peer_tls;
        }
        if r.data_dir.is_none() {
            r.data_dir = me.data_dir.map(Into::into);
        }
        Ok(r)
    }

    /// One initialization, as `serve` with `restore.initialize` runs it at start.
    async fn initialize(&self, mode: Validation) -> Result<(), String> {
        let config = self.restore_config(mode)?;
        let rejoined = crate::restore::rejoin::rejoin_if_lost(
            &config,
            &self.metrics,
            &self.store,
            &self.cancel,
        )
        .await
        .map_err(|e| format!("rejoining the cluster: {e}"))?;
        if !rejoined {
            let done = crate::restore::initialize::initialize_from(
                &self.store,
                self.secondary.as_ref(),
                &config,
                &self.metrics,
            )
            .await
            .map_err(|e| format!("initializing the data directory: {e}"))?;
            tracing::info!(outcome = ?done, "initialization done");
        }
        Ok(())
    }

    /// The cluster's members through `restore.cluster_endpoints` (`--service-endpoints`), or
    /// `None` when none answers: 5 s a try, two tries 2 s apart, as etcd-backup-restore asks.
    async fn members(&self) -> Option<Vec<Listed>> {
        let cluster = self.restore.cluster.as_ref()?;
        for attempt in 0..2 {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            let asked = tokio::time::timeout(Duration::from_secs(5), async {
                let mut client = crate::etcd::connect(cluster).await.ok()?;
                client.member_list().await.ok()
            })
            .await;
            if let Ok(Some(list)) = asked {
                return Some(
                    list.members()
                        .iter()
                        .map(|m| Listed {
                            name: m.name().to_string(),
                            is_learner: m.is_learner(),
                        })
                        .collect(),
                );
            }
        }
        None
    }

    async fn render_config(&self) -> Result<String, String> {
        let text = self.etcd_config()?;
        let members = self.members().await;
        etcd_config::render(&text, &self.pod_name, members.as_deref())
            .map_err(|e: EtcdConfigError| e.to_string())
    }
}

/// The Lease writers `[druid]` asks for, as tasks that run until `cancel`: the member Lease every
/// `heartbeat`; the snapshot Leases after every change of the snapshot actor's status (a stored
/// snapshot) and at least every `period`, while this sidecar's member leads.
pub struct Leases {
    pub druid: Druid,
    pub etcd: crate::config::EtcdConfig,
    pub kube: kube::Client,
    pub actor: tokio::sync::watch::Receiver<crate::snapshot::actor::ActorStatus>,
    /// The snapshot Leases' longest time between writes (the delta period).
    pub period: Duration,
}

impl Leases {
    /// The tasks, or none when neither kind of Lease is asked for.
    pub fn spawn(self, cancel: CancellationToken) -> Vec<tokio::task::JoinHandle<()>> {
        let mut tasks = Vec::new();
        let Some(namespace) = self.druid.config.pod_namespace.clone() else {
            return tasks;
        };
        let api: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
            kube::Api::namespaced(self.kube.clone(), &namespace);
        if self.druid.config.member_lease {
            let (druid, etcd, api, cancel) = (
                self.druid.clone(),
                self.etcd.clone(),
                api.clone(),
                cancel.clone(),
            );
            tasks.push(tokio::spawn(async move {
                member_lease(druid, etcd, api, cancel).await;
            }));
        }
        if self.druid.config.snapshot_leases {
            let (druid, actor, period) = (self.druid.clone(), self.actor, self.period);
            tasks.push(tokio::spawn(async move {
                snapshot_leases(druid, actor, api, period, cancel).await;
            }));
        }
        tasks
    }
}

/// The member Lease, renewed every heartbeat while the local etcd answers.
async fn member_lease(
    druid: Druid,
    etcd: crate::config::EtcdConfig,
    api: kube::Api<k8s_openapi::api::coordination::v1::Lease>,
    cancel: CancellationToken,
) {
    let mut quiet = lease::Quiet::new();
    let mut client: Option<etcd_client::Client> = None;
    while lease::tick(druid.config.heartbeat, &cancel).await {
        let renewed = async {
            let text = druid.etcd_config()?;
            let me = etcd_config::member(&text, &druid.pod_name).map_err(|e| e.to_string())?;
            if client.is_none() {
                client = Some(
                    crate::etcd::connect(&etcd)
                        .await
                        .map_err(|e| format!("etcd: {e}"))?,
                );
            }
            let c = client.as_mut().expect("connected above");
            let status = match c.status().await {
                Ok(s) => s,
                Err(e) => {
                    client = None;
                    return Err(format!("etcd status: {e}"));
                }
            };
            let header = status.header().ok_or("etcd status without a header")?;
            let holder = lease::member_holder(
                header.member_id(),
                header.cluster_id(),
                status.leader() == header.member_id(),
            );
            lease::renew_member(&api, &me.name, holder, lease::tls_enabled(&me.peer_urls))
                .await
                .map_err(|e| e.to_string())
        }
        .await;
        quiet.note("member", renewed);
    }
}

/// The snapshot Leases, while this sidecar leads.
async fn snapshot_leases(
    druid: Druid,
    mut actor: tokio::sync::watch::Receiver<crate::snapshot::actor::ActorStatus>,
    api: kube::Api<k8s_openapi::api::coordination::v1::Lease>,
    period: Duration,
    cancel: CancellationToken,
) {
    let mut quiet = lease::Quiet::new();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(period) => {}
            changed = actor.changed() => if changed.is_err() { return },
        }
        if !actor.borrow_and_update().leader {
            continue;
        }
        let written = lease::update_snapshot_leases(
            &api,
            &druid.store,
            &druid.config.full_snapshot_lease,
            &druid.config.delta_snapshot_lease,
        )
        .await;
        quiet.note("snapshot", written);
    }
}

/// The routes etcd-wrapper calls, from inside the pod: `/initialization/start` reads the whole
/// database, `/initialization/status` answers an outcome once (whoever reads it first consumes
/// it) and `/config` is etcd's configuration, so they answer only `callers`
/// ([`crate::server::pod_only`]: a loopback peer, the token, or a client certificate).
pub fn routes(druid: Druid, callers: crate::server::PodCallers) -> Router {
    Router::new()
        .route("/initialization/start", get(start).post(start))
        .route("/initialization/status", get(status).post(status))
        .route("/config", get(config))
        .route_layer(axum::middleware::from_fn_with_state(
            callers,
            crate::server::pod_only,
        ))
        .with_state(druid)
}

#[derive(Deserialize)]
struct StartQuery {
    mode: Option<String>,
}

/// Always 200 and an empty body, as etcd-backup-restore answers; starts an initialization when
/// none has run since the last outcome was read. Any mode but `sanity` is `full`.
async fn start(State(d): State<Druid>, Query(q): Query<StartQuery>) -> StatusCode {
    let mode = match q.mode.as_deref() {
        Some("sanity") => Validation::Sanity,
        _ => Validation::Full,
    };
    if !d.status().start() {
        return StatusCode::OK;
    }
    tracing::info!(
        ?mode,
        "etcd-wrapper asked for the data directory's initialization"
    );
    // On a blocking thread driving it: the restore's future borrows across awaits in a way the
    // compiler cannot prove `Send` for every lifetime (rust-lang/rust#102211), and it runs for
    // minutes, off the request.
    let handle = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        let result = handle.block_on(d.initialize(mode));
        if let Err(e) = &result {
            tracing::error!(error = %e, "initialization failed; etcd-wrapper will ask again");
        }
        d.status().finish(result.is_ok());
    });
    StatusCode::OK
}

async fn status(State(d): State<Druid>) -> Response {
    let now = d.status().read();
    (
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        now.as_str(),
    )
        .into_response()
}

async fn config(State(d): State<Druid>) -> Response {
    match d.render_config().await {
        Ok(yaml) => ([(header::CONTENT_TYPE, "application/yaml")], yaml).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "cannot serve etcd's configuration");
            (StatusCode::INTERNAL_SERVER_ERROR, e).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::{ClientCert, PodCallers};
    use axum::body::Body;
    use axum::extract::ConnectInfo;
    use axum::http::Request;
    use std::net::SocketAddr;

    /// A `Druid` whose initialization would fail (no etcd configuration file): the tests below
    /// only look at who reaches the handlers.
    fn druid() -> Druid {
        let sources = crate::config::Sources {
            file: None,
            env: &std::collections::HashMap::<String, String>::new(),
            overrides: vec![],
        };
        let (config, _) = crate::config::Config::load(&sources).unwrap();
        Druid::new(
            DruidConfig::without_leases("/nonexistent/etcd.conf.yaml", "etcd-main-0"),
            config.restore,
            SnapshotStore::new(Arc::new(object_store::memory::InMemory::new()), ""),
            None,
            InitializeMetrics::default(),
            CancellationToken::new(),
        )
    }

    /// A request as the server's connection loop hands it over: the peer's address (when
    /// `peer` is given), a client certificate's verdict, and a bearer token.
    fn request(path: &str, peer: Option<&str>, cert: bool, token: Option<&str>) -> Request<Body> {
        let mut req = Request::get(path);
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let mut req = req.body(Body::empty()).unwrap();
        if let Some(p) = peer {
            req.extensions_mut()
                .insert(ConnectInfo(p.parse::<SocketAddr>().unwrap()));
        }
        if cert {
            req.extensions_mut().insert(ClientCert(true));
        }
        req
    }

    async fn call(d: &Druid, token: Option<&str>, req: Request<Body>) -> (StatusCode, String) {
        let callers = PodCallers {
            token: token.map(|t| crate::config::Secret::Value(t.into())),
        };
        crate::server::respond(routes(d.clone(), callers), req).await
    }

    /// Only the peer address a request carries is checked here, set by hand: the tests can
    /// only connect from loopback, so that the server's connection loop sets it from the real
    /// peer (plain and TLS) is shown in tests/http_limits.rs, and that a pod's containers reach
    /// each other over loopback is Kubernetes's to keep.
    #[tokio::test]
    async fn the_initialization_and_config_answer_only_the_pod_the_token_or_a_certificate() {
        let d = druid();
        let paths = [
            "/initialization/start?mode=full",
            "/initialization/status",
            "/config",
        ];
        // An outcome nobody has read yet: whoever is refused must not consume it.
        d.status().finish(true);
        for path in paths {
            for token in [None, Some("sekrit")] {
                for peer in [Some("10.1.2.3:40000"), Some("[fd00::7]:40000"), None] {
                    let (code, body) = call(&d, token, request(path, peer, false, None)).await;
                    let want = if token.is_some() {
                        StatusCode::UNAUTHORIZED
                    } else {
                        StatusCode::FORBIDDEN
                    };
                    assert_eq!(code, want, "{path} from {peer:?}, token {token:?}: {body}");
                }
                let (code, _) = call(
                    &d,
                    token,
                    request(path, Some("10.1.2.3:40000"), false, Some("wrong")),
                )
                .await;
                assert!(code.is_client_error(), "{path}: a wrong token got {code}");
            }
        }
        assert_eq!(
            *d.status(),
            Status::Successful,
            "a refused caller changed the status"
        );

        // From inside the pod (IPv4 and IPv6 loopback, and IPv4 in IPv6), with a certificate,
        // or with the token: served. The status is read once (consumed), as etcd-backup-restore
        // answers.
        for (peer, cert, token, configured) in [
            (Some("127.0.0.1:40000"), false, None, None),
            (Some("[::1]:40000"), false, None, Some("sekrit")),
            (Some("[::ffff:127.0.0.1]:40000"), false, None, None),
            (Some("10.1.2.3:40000"), true, None, None),
            (
                Some("10.1.2.3:40000"),
                false,
                Some("sekrit"),
                Some("sekrit"),
            ),
        ] {
            d.status().finish(true);
            let (code, body) = call(
                &d,
                configured,
                request("/initialization/status", peer, cert, token),
            )
            .await;
            assert_eq!(
                (code, body.as_str()),
                (StatusCode::OK, "Successful"),
                "{peer:?} cert {cert} token {token:?}"
            );
            // `/config` is reached (and fails: there is no etcd configuration file here).
            let (code, body) = call(&d, configured, request("/config", peer, cert, token)).await;
            assert_eq!(code, StatusCode::INTERNAL_SERVER_ERROR, "{peer:?}: {body}");
        }
    }

    /// Every status, every event: what etcd-backup-restore's state machine does.
    #[test]
    fn the_status_machine_is_etcd_backup_restores() {
        use Status::*;
        for s in [New, Progress, Successful, Failed] {
            let mut x = s;
            assert_eq!(x.start(), s == New, "start from {s:?}");
            assert_eq!(x, if s == New { Progress } else { s });
            let mut x = s;
            assert_eq!(x.read(), s);
            let after = if matches!(s, Successful | Failed) {
                New
            } else {
                s
            };
            assert_eq!(x, after, "read from {s:?}");
            for ok in [true, false] {
                let mut x = s;
                x.finish(ok);
                assert_eq!(x, if ok { Successful } else { Failed });
            }
        }
    }
}
