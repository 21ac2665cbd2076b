//! Liveness, readiness and metrics of `etcd-warden-operator kube` over HTTP.
//!
//! Every internal task (the Lease loop, each watch, the reconcile loop, the Event publisher) is
//! spawned through [`TaskHealth::spawn`], which marks it dead when its future ends for any
//! reason: returned, panicked, or dropped. `/healthz` answers 200 only while every one is alive
//! and 503 naming the dead ones otherwise; nothing marks a task alive again, so a dead task
//! cannot leave it at 200 (the kubelet restarts the pod). `/readyz` also waits until each watch
//! has listed once. `/metrics` is the operator's registry (the same metrics as `local`, plus
//! whether this replica holds the Lease).

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio_util::task::TaskTracker;
use tracing::error;

#[derive(Debug, Clone, PartialEq, Eq)]
struct TaskState {
    alive: bool,
    /// Readiness gate: `Some(false)` until [`TaskHealth::ready`] opens it.
    ready: Option<bool>,
    /// What a live task waits for, shown on `/healthz` (it stays healthy meanwhile).
    detail: Option<String>,
}

/// Which internal tasks run, and which have become ready; cheap to clone (a shared handle).
#[derive(Debug, Clone, Default)]
pub struct TaskHealth {
    tasks: Arc<Mutex<BTreeMap<String, TaskState>>>,
}

/// Marks its task dead when dropped: when the task's future ends, however it ends.
struct Alive {
    name: String,
    health: TaskHealth,
}

impl Drop for Alive {
    fn drop(&mut self) {
        let panicking = std::thread::panicking();
        if let Some(t) = self.health.lock().get_mut(&self.name) {
            t.alive = false;
        }
        if panicking {
            error!(task = %self.name, "internal task panicked");
        }
    }
}

impl TaskHealth {
    /// No task yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, TaskState>> {
        self.tasks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Spawns `fut` on `tracker` as the task `name` (alive until its future ends); with
    /// `gated`, the task must call [`TaskHealth::ready`] before `/readyz` answers 200.
    pub fn spawn<F>(&self, tracker: &TaskTracker, name: &str, gated: bool, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.lock().insert(
            name.to_owned(),
            TaskState {
                alive: true,
                ready: gated.then_some(false),
                detail: None,
            },
        );
        let guard = Alive {
            name: name.to_owned(),
            health: self.clone(),
        };
        tracker.spawn(async move {
            let _guard = guard;
            fut.await;
        });
    }

    /// Opens the readiness gate of `name`.
    pub fn ready(&self, name: &str) {
        if let Some(TaskState {
            ready: Some(r @ false),
            ..
        }) = self.lock().get_mut(name)
        {
            *r = true;
        }
    }

    /// Sets (or with `None` clears) what `name` waits for, as `/healthz` shows it.
    pub fn detail(&self, name: &str, detail: Option<&str>) {
        if let Some(t) = self.lock().get_mut(name) {
            t.detail = detail.map(str::to_owned);
        }
    }

    /// (task, what it waits for) of every task that says.
    pub fn details(&self) -> Vec<(String, String)> {
        self.lock()
            .iter()
            .filter_map(|(n, t)| Some((n.clone(), t.detail.clone()?)))
            .collect()
    }

    /// Names of the tasks that are no longer running.
    pub fn dead(&self) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|(_, t)| !t.alive)
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Names of the tasks whose readiness gate is still closed.
    pub fn unready(&self) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|(_, t)| t.ready == Some(false))
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Every task's name.
    pub fn names(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }
}

/// What the HTTP handlers read.
#[derive(Clone)]
pub struct HealthState {
    /// The internal tasks.
    pub tasks: TaskHealth,
    /// The metrics.
    pub registry: Arc<Registry>,
}

/// `GET /healthz`, `GET /readyz`, `GET /metrics`.
pub fn router(state: HealthState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

fn answer(code: StatusCode, body: String) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body,
    )
        .into_response()
}

async fn healthz(State(s): State<HealthState>) -> Response {
    let dead = s.tasks.dead();
    if dead.is_empty() {
        let mut body = format!("ok: {}\n", s.tasks.names().join(", "));
        for (task, detail) in s.tasks.details() {
            body.push_str(&format!("{task}: {detail}\n"));
        }
        answer(StatusCode::OK, body)
    } else {
        answer(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("dead: {}\n", dead.join(", ")),
        )
    }
}

async fn readyz(State(s): State<HealthState>) -> Response {
    let dead = s.tasks.dead();
    if !dead.is_empty() {
        return answer(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("dead: {}\n", dead.join(", ")),
        );
    }
    let unready = s.tasks.unready();
    if unready.is_empty() {
        answer(StatusCode::OK, "ready\n".into())
    } else {
        answer(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not synced yet: {}\n", unready.join(", ")),
        )
    }
}

async fn metrics(State(s): State<HealthState>) -> Response {
    let mut body = String::new();
    if prometheus_client::encoding::text::encode(&mut body, &s.registry).is_err() {
        return answer(
            StatusCode::INTERNAL_SERVER_ERROR,
            "encoding metrics failed\n".into(),
        );
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;

    async fn get(state: &HealthState, path: &str) -> (StatusCode, String) {
        let req = Request::get(path).body(Body::empty()).unwrap();
        crate::server::respond(router(state.clone()), req).await
    }

    #[tokio::test]
    async fn a_task_that_ends_however_it_ends_turns_healthz_503_for_good() {
        let tasks = TaskHealth::new();
        let tracker = TaskTracker::new();
        let state = HealthState {
            tasks: tasks.clone(),
            registry: Arc::new(Registry::default()),
        };
        let stop_returning = tokio_util::sync::CancellationToken::new();
        let stop_panicking = tokio_util::sync::CancellationToken::new();
        let forever = tokio_util::sync::CancellationToken::new();
        {
            let c = stop_returning.clone();
            tasks.spawn(
                &tracker,
                "returns",
                false,
                async move { c.cancelled().await },
            );
        }
        {
            let c = stop_panicking.clone();
            tasks.spawn(&tracker, "panics", false, async move {
                c.cancelled().await;
                panic!("a bug");
            });
        }
        {
            let c = forever.clone();
            tasks.spawn(&tracker, "watch", true, async move { c.cancelled().await });
        }
        let (code, body) = get(&state, "/healthz").await;
        assert_eq!(code, StatusCode::OK, "{body}");
        assert!(body.contains("panics, returns, watch"), "{body}");
        // A live task waiting for something says so and stays healthy.
        tasks.detail("returns", Some("waiting for a CRD"));
        let (code, body) = get(&state, "/healthz").await;
        assert_eq!(code, StatusCode::OK, "{body}");
        assert!(body.contains("\nreturns: waiting for a CRD\n"), "{body}");
        tasks.detail("returns", None);
        assert!(!get(&state, "/healthz").await.1.contains("waiting"));
        // Not ready until the gated task says so.
        let (code, body) = get(&state, "/readyz").await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("watch"), "{body}");
        tasks.ready("watch");
        assert_eq!(get(&state, "/readyz").await.0, StatusCode::OK);

        stop_panicking.cancel();
        let wait = async {
            while tasks.dead().is_empty() {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(5), wait)
            .await
            .unwrap();
        let (code, body) = get(&state, "/healthz").await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body.trim(), "dead: panics");
        assert_eq!(
            get(&state, "/readyz").await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );

        stop_returning.cancel();
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let (code, body) = get(&state, "/healthz").await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body.trim(), "dead: panics, returns");
        // Readiness reported again by a live task does not revive anything.
        tasks.ready("watch");
        assert_eq!(
            get(&state, "/healthz").await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        forever.cancel();
        tracker.close();
        tracker.wait().await;
        assert_eq!(tasks.dead().len(), 3);
    }
}
