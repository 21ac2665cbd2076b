//! A live writer: puts distinct keys through the Service for as long as it runs, recording every
//! acknowledged put with its revision (the response header's) and when it was acknowledged.
//!
//! Errors do not stop it: it drops its client (so the next put goes over a new connection, which
//! the Service only forwards to a ready member), waits a little and goes on.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// One acknowledged put.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ack {
    pub key: String,
    /// The revision etcd answered with (the put's mod revision).
    pub revision: i64,
    /// When the acknowledgement arrived, from the writer's `epoch`.
    pub at: Duration,
}

#[derive(Default)]
struct Log {
    acks: Vec<Ack>,
    /// The last few errors, for failure reports.
    errors: Vec<(Duration, String)>,
}

/// A running writer; stops on [`Writer::stop`] or drop.
pub struct Writer {
    log: Arc<Mutex<Log>>,
    failures: Arc<AtomicU64>,
    stop: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl Writer {
    /// Starts writing `<prefix>/<n>` to `endpoint`, pausing `pause` after each acknowledged put.
    pub fn start(endpoint: String, prefix: String, epoch: Instant, pause: Duration) -> Writer {
        let log = Arc::new(Mutex::new(Log::default()));
        let failures = Arc::new(AtomicU64::new(0));
        let stop = CancellationToken::new();
        let task = tokio::spawn(run(
            endpoint,
            prefix,
            epoch,
            pause,
            log.clone(),
            failures.clone(),
            stop.clone(),
        ));
        Writer {
            log,
            failures,
            stop,
            task: Some(task),
        }
    }

    /// Every acknowledged put so far, in order.
    pub fn acks(&self) -> Vec<Ack> {
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .acks
            .clone()
    }

    /// How many puts were acknowledged so far.
    pub fn ack_count(&self) -> usize {
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .acks
            .len()
    }

    /// Failed puts and connects so far.
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::SeqCst)
    }

    /// The last errors (time, message).
    pub fn recent_errors(&self) -> Vec<(Duration, String)> {
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .errors
            .clone()
    }

    /// Stops writing; a put in flight is abandoned (and not counted).
    pub async fn stop(&mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A client for `endpoint` as the writers connect: 500 ms to connect, 2 s for each request, the
/// whole attempt within 2 s; the error says why not.
pub async fn connect(endpoint: &str) -> Result<Client, String> {
    let options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_millis(500))
        .with_timeout(Duration::from_secs(2));
    let connect = Client::connect([endpoint], Some(options));
    match tokio::time::timeout(Duration::from_secs(2), connect).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(format!("connect: {e}")),
        Err(_) => Err("connect: timed out".into()),
    }
}

async fn run(
    endpoint: String,
    prefix: String,
    epoch: Instant,
    pause: Duration,
    log: Arc<Mutex<Log>>,
    failures: Arc<AtomicU64>,
    stop: CancellationToken,
) {
    let mut client: Option<Client> = None;
    let mut n: u64 = 0;
    let fail = |message: String| {
        failures.fetch_add(1, Ordering::SeqCst);
        let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
        log.errors.push((epoch.elapsed(), message));
        let excess = log.errors.len().saturating_sub(20);
        log.errors.drain(..excess);
    };
    while !stop.is_cancelled() {
        if client.is_none() {
            match tokio::select! {
                _ = stop.cancelled() => return,
                c = connect(&endpoint) => c,
            } {
                Ok(c) => client = Some(c),
                Err(e) => fail(e),
            }
            if client.is_none() {
                backoff(&stop).await;
                continue;
            }
        }
        let Some(c) = client.as_mut() else { continue };
        let key = format!("{prefix}/{n:08}");
        let put = c.put(key.clone(), format!("v{n}"), None);
        let answer = tokio::select! {
            _ = stop.cancelled() => return,
            a = tokio::time::timeout(Duration::from_secs(3), put) => a,
        };
        match answer {
            Ok(Ok(resp)) => {
                let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
                log.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .acks
                    .push(Ack {
                        key,
                        revision,
                        at: epoch.elapsed(),
                    });
                n += 1;
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {}
                }
            }
            Ok(Err(e)) => {
                fail(format!("put {key}: {e}"));
                client = None;
                n += 1; // it may have been applied: never reuse a key
                backoff(&stop).await;
            }
            Err(_) => {
                fail(format!("put {key}: timed out"));
                client = None;
                n += 1;
                backoff(&stop).await;
            }
        }
    }
}

async fn backoff(stop: &CancellationToken) {
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = tokio::time::sleep(Duration::from_millis(50)) => {}
    }
}
