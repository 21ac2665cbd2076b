//! A Kubernetes Service in front of etcd's client port, as a TCP proxy on loopback.
//!
//! A new connection is forwarded to a member whose sidecar's `GET /healthz` last answered 200
//! (each sidecar is probed every `probe_every`; no answer counts as not ready), round robin among
//! the ready ones; with none ready it is closed at once. An open connection stays forwarded until
//! either side closes it, whatever readiness says later: that is why the sidecar must kill etcd
//! (readiness alone does not drop a client's open connection).
//!
//! What it does not model: kube-proxy's propagation delay (endpoints reach every node's rules a
//! few hundred ms to seconds after the probe changes), the kubelet's probe period and failure
//! threshold (10 s × 3 by default), conntrack keeping NATed flows to a removed endpoint.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::{CancellationToken, DropGuard};

/// One endpoint of the Service: where to forward, and the readiness probe that gates it.
#[derive(Debug, Clone)]
pub struct Backend {
    /// etcd's client address.
    pub target: SocketAddr,
    /// The sidecar's `/healthz` URL.
    pub health: String,
}

/// A running Service; stops (with every forwarded connection) on drop.
pub struct Service {
    pub addr: SocketAddr,
    ready: Arc<Vec<AtomicBool>>,
    forwarded: Arc<Vec<AtomicU64>>,
    refused: Arc<AtomicU64>,
    _stop: DropGuard,
}

impl Service {
    /// Listens on an ephemeral loopback port and starts probing the backends.
    pub async fn start(backends: Vec<Backend>, probe_every: Duration) -> Service {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the Service");
        let addr = listener.local_addr().expect("Service address");
        let ready: Arc<Vec<AtomicBool>> =
            Arc::new(backends.iter().map(|_| AtomicBool::new(false)).collect());
        let forwarded: Arc<Vec<AtomicU64>> =
            Arc::new(backends.iter().map(|_| AtomicU64::new(0)).collect());
        let refused = Arc::new(AtomicU64::new(0));
        let stop = CancellationToken::new();
        for (i, b) in backends.iter().enumerate() {
            tokio::spawn(probe(
                b.health.clone(),
                i,
                ready.clone(),
                probe_every,
                stop.clone(),
            ));
        }
        tokio::spawn(accept(
            listener,
            backends,
            ready.clone(),
            forwarded.clone(),
            refused.clone(),
            stop.clone(),
        ));
        Service {
            addr,
            ready,
            forwarded,
            refused,
            _stop: stop.drop_guard(),
        }
    }

    /// `http://127.0.0.1:<port>`: what clients are configured with.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Which backends the Service currently considers ready.
    pub fn ready(&self) -> Vec<bool> {
        self.ready
            .iter()
            .map(|r| r.load(Ordering::SeqCst))
            .collect()
    }

    /// Connections forwarded to each backend so far.
    pub fn forwarded(&self) -> Vec<u64> {
        self.forwarded
            .iter()
            .map(|r| r.load(Ordering::SeqCst))
            .collect()
    }

    /// Connections closed at once because no backend was ready.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::SeqCst)
    }
}

async fn probe(
    url: String,
    i: usize,
    ready: Arc<Vec<AtomicBool>>,
    every: Duration,
    stop: CancellationToken,
) {
    let client = super::http_client(Duration::from_millis(500));
    loop {
        let ok = matches!(client.get(&url).send().await, Ok(r) if r.status().as_u16() == 200);
        ready[i].store(ok, Ordering::SeqCst);
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

async fn accept(
    listener: TcpListener,
    backends: Vec<Backend>,
    ready: Arc<Vec<AtomicBool>>,
    forwarded: Arc<Vec<AtomicU64>>,
    refused: Arc<AtomicU64>,
    stop: CancellationToken,
) {
    let next = AtomicUsize::new(0);
    loop {
        let conn = tokio::select! {
            _ = stop.cancelled() => return,
            c = listener.accept() => c,
        };
        let Ok((client, _)) = conn else { continue };
        let candidates: Vec<usize> = (0..backends.len())
            .filter(|i| ready[*i].load(Ordering::SeqCst))
            .collect();
        if candidates.is_empty() {
            refused.fetch_add(1, Ordering::SeqCst);
            drop(client);
            continue;
        }
        let pick = candidates[next.fetch_add(1, Ordering::SeqCst) % candidates.len()];
        forwarded[pick].fetch_add(1, Ordering::SeqCst);
        let target = backends[pick].target;
        let stop = stop.clone();
        tokio::spawn(async move {
            let connect = tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(target));
            let Ok(Ok(mut upstream)) = connect.await else {
                return;
            };
            let mut client = client;
            let _ = client.set_nodelay(true);
            let _ = upstream.set_nodelay(true);
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {}
            }
        });
    }
}
