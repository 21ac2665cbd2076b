//! etcd in a "pod": a kubelet-like loop starts a member again whenever it dies (the sidecar
//! kills etcd when it loses ownership; the kubelet brings it back).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tokio::sync::Mutex;

use super::etcd::{EtcdCluster, Release};

/// etcd plus a kubelet-like loop that starts it again whenever it dies, counting deaths.
pub struct Pod {
    pub etcd: Arc<Mutex<EtcdCluster>>,
    deaths: Arc<AtomicU32>,
    /// Members that died for good: the kubelet no longer starts them.
    buried: Arc<std::sync::Mutex<std::collections::BTreeSet<usize>>>,
    stop: tokio_util::sync::CancellationToken,
}

impl Pod {
    /// One member.
    pub async fn start() -> Pod {
        Self::cluster(1).await
    }

    /// `n` members, each restarted by the "kubelet" when it dies.
    pub async fn cluster(n: usize) -> Pod {
        let etcd = Arc::new(Mutex::new(EtcdCluster::start(n, Release::V35).await));
        let deaths = Arc::new(AtomicU32::new(0));
        let stop = tokio_util::sync::CancellationToken::new();
        let buried = Arc::new(std::sync::Mutex::new(std::collections::BTreeSet::new()));
        let (e, d, s, b) = (etcd.clone(), deaths.clone(), stop.clone(), buried.clone());
        tokio::spawn(async move {
            while !s.is_cancelled() {
                {
                    let mut cluster = e.lock().await;
                    for (i, m) in cluster.members.iter_mut().enumerate() {
                        let gone = b.lock().map(|b| b.contains(&i)).unwrap_or(false);
                        if !gone && !m.is_running() {
                            d.fetch_add(1, Ordering::SeqCst);
                            m.kill(); // reap
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            m.start();
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        Pod {
            etcd,
            deaths,
            buried,
            stop,
        }
    }

    /// Member `i` dies for good (its machine is gone): killed, never started again.
    pub async fn bury(&self, i: usize) {
        self.buried.lock().expect("lock").insert(i);
        self.etcd.lock().await.members[i].kill();
    }

    /// The first member's client URL.
    pub async fn endpoint(&self) -> String {
        self.etcd.lock().await.endpoints()[0].clone()
    }

    /// How often a member died and was started again.
    pub fn deaths(&self) -> u32 {
        self.deaths.load(Ordering::SeqCst)
    }

    /// Writes keys and returns the revision of the last acknowledged write.
    pub async fn write(&self, tag: &str, n: usize) -> i64 {
        let mut client = etcd_client::Client::connect([self.endpoint().await], None)
            .await
            .unwrap();
        let mut rev = 0;
        for i in 0..n {
            rev = client
                .put(format!("/{tag}/{i}"), format!("v{i}"), None)
                .await
                .unwrap()
                .header()
                .unwrap()
                .revision();
        }
        rev
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
