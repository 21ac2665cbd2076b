//! Clients built from configuration (endpoints, TLS, auth).
//!
//! TLS files and the password file are read on every [`connect`], so reconnecting picks up a
//! rotated certificate or password.
//!
//! etcd forgets its auth tokens: a simple token when etcd restarts (the sidecar kills etcd, the
//! kubelet starts it again), any token once its TTL passes. A client with credentials
//! authenticates again when etcd refuses its token in a unary call (etcd-client's automatic
//! refresh). That does not cover what the sidecar streams: etcd refuses a stale token in a
//! snapshot stream with an error the refresh does not recognise, and in a watch only in the
//! watch's first response, after the call succeeded. So [`RotatingClient::client`] has etcd check
//! the token with a small read first, which the refresh does cover.

use crate::config::EtcdConfig;

/// Errors connecting to etcd.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// A TLS or password file could not be read.
    #[error("cannot read {what} {path}: {source}")]
    File {
        /// Which file.
        what: &'static str,
        /// Its path.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The client failed.
    #[error("etcd {endpoints}: {source}")]
    Client {
        /// The endpoints, comma-separated.
        endpoints: String,
        /// The client error.
        #[source]
        source: etcd_client::Error,
    },
}

/// The options a client is built with (TLS material and password read now).
pub fn connect_options(config: &EtcdConfig) -> Result<etcd_client::ConnectOptions, EtcdError> {
    let read = |what: &'static str, path: &std::path::Path| {
        std::fs::read(path).map_err(|source| EtcdError::File {
            what,
            path: path.display().to_string(),
            source,
        })
    };
    // The request timeout bounds each call until its response starts; streams (snapshot, watch)
    // then run as long as they need.
    let mut opts = etcd_client::ConnectOptions::new()
        .with_connect_timeout(config.connect_timeout)
        .with_timeout(config.request_timeout)
        .with_keep_alive(std::time::Duration::from_secs(10), config.connect_timeout);
    if let (Some(user), Some(password)) = (&config.username, &config.password) {
        let password = password.read().map_err(|source| EtcdError::File {
            what: "password file",
            path: match password {
                crate::config::Secret::File(p) => p.display().to_string(),
                crate::config::Secret::Value(_) => String::new(),
            },
            source,
        })?;
        // etcd forgets a token when it restarts, or when the token's TTL passes: unary calls
        // refused for it authenticate again and are retried once.
        opts = opts.with_user(user, password).with_auto_token_refresh(true);
    }
    if let Some(tls) = &config.tls {
        let mut t = etcd_client::TlsOptions::new();
        if let Some(ca) = &tls.ca_file {
            t = t.ca_certificate(etcd_client::Certificate::from_pem(read("CA file", ca)?));
        }
        if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
            t = t.identity(etcd_client::Identity::from_pem(
                read("certificate file", cert)?,
                read("key file", key)?,
            ));
        }
        opts = opts.with_tls(t);
    }
    Ok(opts)
}

/// Connects to the configured endpoints.
pub async fn connect(config: &EtcdConfig) -> Result<etcd_client::Client, EtcdError> {
    let opts = connect_options(config)?;
    etcd_client::Client::connect(&config.endpoints, Some(opts))
        .await
        .map_err(|source| EtcdError::Client {
            endpoints: config.endpoints.join(","),
            source,
        })
}

/// A client rebuilt when its TLS files or password file change, so a long-running sidecar
/// follows certificate and password rotation without a restart, and whose auth token is
/// renewed when etcd no longer knows it.
pub struct RotatingClient {
    config: EtcdConfig,
    client: etcd_client::Client,
    stamp: Vec<Option<std::time::SystemTime>>,
}

/// The modification times of the files a client is built from.
/// When each TLS and password file of `config` was last modified: a change means the
/// credentials were rotated and clients should connect again.
pub fn stamp(config: &EtcdConfig) -> Vec<Option<std::time::SystemTime>> {
    let mut files: Vec<&std::path::Path> = Vec::new();
    if let Some(t) = &config.tls {
        files.extend(t.ca_file.as_deref());
        files.extend(t.cert_file.as_deref());
        files.extend(t.key_file.as_deref());
    }
    if let Some(crate::config::Secret::File(p)) = &config.password {
        files.push(p);
    }
    files
        .iter()
        .map(|f| std::fs::metadata(f).and_then(|m| m.modified()).ok())
        .collect()
}

impl RotatingClient {
    /// Connects with the files as they are now.
    pub async fn connect(config: &EtcdConfig) -> Result<Self, EtcdError> {
        let stamp = stamp(config);
        let client = connect(config).await?;
        Ok(RotatingClient {
            config: config.clone(),
            client,
            stamp,
        })
    }

    /// The configuration it was built from (for clients to other members with the same TLS
    /// material and credentials).
    pub fn config(&self) -> &EtcdConfig {
        &self.config
    }

    /// The client, rebuilt first when a file it was built from changed since, and with
    /// credentials, its token checked (see the module docs). When the new files cannot be used
    /// yet (half written), the old client is kept and the error logged.
    pub async fn client(&mut self) -> etcd_client::Client {
        let now = stamp(&self.config);
        if now != self.stamp {
            match connect(&self.config).await {
                Ok(c) => {
                    tracing::info!("etcd credentials changed on disk; reconnected");
                    self.client = c;
                    self.stamp = now;
                    return self.client.clone();
                }
                Err(e) => {
                    tracing::warn!(error = %e, "etcd credentials changed but cannot be used yet")
                }
            }
        }
        if self.config.username.is_some() {
            self.check_token().await;
        }
        self.client.clone()
    }

    /// A serializable, count-only read of one key, answered by the member itself: etcd checks
    /// the token before anything else, and a refusal makes the client authenticate again (the
    /// clones of a client share its token). Any other outcome (no permission on the key, etcd
    /// down) is left to the caller's own call; the check waits [`TOKEN_CHECK_TIMEOUT`] at most.
    async fn check_token(&self) {
        let opts = etcd_client::GetOptions::new()
            .with_serializable()
            .with_count_only()
            .with_limit(1);
        let mut kv = self.client.kv_client();
        let limit = self.config.request_timeout.min(TOKEN_CHECK_TIMEOUT);
        match tokio::time::timeout(limit, kv.get(TOKEN_CHECK_KEY, Some(opts))).await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => tracing::debug!(%error, "etcd token check failed"),
            Err(_) => tracing::debug!(?limit, "etcd token check timed out"),
        }
    }
}

/// The key [`RotatingClient`] reads to have etcd check its token (it need not exist).
const TOKEN_CHECK_KEY: &str = "/etcd-warden/token-check";

/// How long a token check may delay a call.
const TOKEN_CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Secret, TlsFiles};
    use std::time::Duration;

    fn cfg() -> EtcdConfig {
        EtcdConfig {
            endpoints: vec!["http://127.0.0.1:1".into()],
            tls: None,
            username: None,
            password: None,
            connect_timeout: Duration::from_millis(200),
            request_timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn missing_files_are_named() {
        let mut c = cfg();
        c.username = Some("root".into());
        c.password = Some(Secret::File("/nonexistent/pw".into()));
        let e = connect_options(&c).unwrap_err().to_string();
        assert!(e.contains("password file /nonexistent/pw"), "{e}");
        let mut c = cfg();
        c.tls = Some(TlsFiles {
            ca_file: Some("/nonexistent/ca.pem".into()),
            cert_file: None,
            key_file: None,
        });
        let e = connect_options(&c).unwrap_err().to_string();
        assert!(e.contains("CA file /nonexistent/ca.pem"), "{e}");
    }
}
