//! etcd's health as the sidecar judges it, in one place: the member answers a status request
//! within a timeout and knows a raft leader. Used for readiness without ownership checks
//! ([`follow_etcd`]) and by the ownership watchdog, which also learns the member's ID from it.

use std::time::Duration;

use tokio::sync::{Mutex, watch};
use tokio_util::sync::CancellationToken;

use crate::config::EtcdConfig;
use crate::server::Readiness;

/// How long one etcd health check may take.
pub const TIMEOUT: Duration = Duration::from_secs(2);
/// How often readiness follows etcd's health.
pub const INTERVAL: Duration = Duration::from_secs(2);

/// Why no client could be made.
#[derive(Debug, thiserror::Error)]
pub enum Unreachable {
    /// Connecting failed.
    #[error(transparent)]
    Connect(#[from] crate::etcd::EtcdError),
    /// Connecting took too long.
    #[error("etcd did not accept a connection within {0:?}")]
    Timeout(Duration),
}

/// One health check's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// The member answered and knows a leader.
    pub healthy: bool,
    /// The member's ID, when it answered.
    pub member_id: Option<u64>,
    /// Why it is (not) healthy, in words.
    pub detail: String,
}

/// Checks the member at the configured endpoints. The client is made on first use and again
/// after a failure, so a restarted etcd is found without waiting for the old connection's
/// backoff, and a restarted etcd's new auth token is fetched.
pub struct HealthCheck {
    config: EtcdConfig,
    timeout: Duration,
    client: Mutex<Option<etcd_client::Client>>,
}

impl HealthCheck {
    /// Checks the member at `config`'s endpoints, each check bounded by `timeout`.
    pub fn new(config: EtcdConfig, timeout: Duration) -> Self {
        HealthCheck {
            config,
            timeout,
            client: Mutex::new(None),
        }
    }

    /// A connected client (made now if there is none), or why there is none.
    pub async fn client(&self) -> Result<etcd_client::Client, Unreachable> {
        let mut slot = self.client.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        match tokio::time::timeout(self.timeout, crate::etcd::connect(&self.config)).await {
            Ok(Ok(client)) => {
                *slot = Some(client.clone());
                Ok(client)
            }
            Ok(Err(e)) => Err(Unreachable::Connect(e)),
            Err(_) => Err(Unreachable::Timeout(self.timeout)),
        }
    }

    /// Drops the client, so the next use connects again.
    pub async fn reset(&self) {
        *self.client.lock().await = None;
    }

    /// One check.
    pub async fn check(&self) -> Health {
        let mut client = match self.client().await {
            Ok(c) => c,
            Err(e) => {
                return Health {
                    healthy: false,
                    member_id: None,
                    detail: format!("etcd unreachable: {e}"),
                };
            }
        };
        match tokio::time::timeout(self.timeout, client.status()).await {
            Ok(Ok(status)) => {
                let member_id = status.header().map(|h| h.member_id()).filter(|&id| id != 0);
                let healthy = status.leader() != 0;
                Health {
                    healthy,
                    member_id,
                    detail: if healthy {
                        "etcd is healthy".into()
                    } else {
                        "etcd has no leader".into()
                    },
                }
            }
            Ok(Err(e)) => {
                self.reset().await;
                Health {
                    healthy: false,
                    member_id: None,
                    detail: format!("etcd unreachable: {e}"),
                }
            }
            Err(_) => {
                self.reset().await;
                Health {
                    healthy: false,
                    member_id: None,
                    detail: format!("etcd did not answer within {:?}", self.timeout),
                }
            }
        }
    }
}

/// Keeps readiness at "etcd answers and has a leader" until `cancel` fires: a plain backup
/// sidecar, with no ownership checks.
pub async fn follow_etcd(
    check: HealthCheck,
    readiness: &watch::Sender<Readiness>,
    cancel: CancellationToken,
) {
    let mut tick = tokio::time::interval(INTERVAL);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let health = check.check().await;
        crate::server::set_readiness(readiness, health.healthy, "Active", &health.detail);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn unreachable_etcd_is_unhealthy_with_a_reason() {
        let config = EtcdConfig {
            endpoints: vec!["http://127.0.0.1:1".into()],
            tls: None,
            username: None,
            password: None,
            connect_timeout: Duration::from_millis(200),
            request_timeout: Duration::from_millis(200),
        };
        let health = HealthCheck::new(config, Duration::from_millis(300))
            .check()
            .await;
        assert!(!health.healthy);
        assert_eq!(health.member_id, None);
        assert!(health.detail.contains("etcd"), "{}", health.detail);
    }
}
