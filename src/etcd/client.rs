//! The etcd seam: clients built from configuration (endpoints, TLS, auth).
//!
//! TLS files and the password file are read on every [`connect`], so reconnecting picks up a
//! rotated certificate or password.

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
        opts = opts.with_user(user, password);
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
/// follows certificate and password rotation without a restart.
pub struct RotatingClient {
    config: EtcdConfig,
    client: etcd_client::Client,
    stamp: Vec<Option<std::time::SystemTime>>,
}

/// The modification times of the files a client is built from.
fn stamp(config: &EtcdConfig) -> Vec<Option<std::time::SystemTime>> {
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

    /// The client, rebuilt first when a file it was built from changed since. When the new
    /// files cannot be used yet (half written), the old client is kept and the error logged.
    pub async fn client(&mut self) -> etcd_client::Client {
        let now = stamp(&self.config);
        if now != self.stamp {
            match connect(&self.config).await {
                Ok(c) => {
                    tracing::info!("etcd credentials changed on disk; reconnected");
                    self.client = c;
                    self.stamp = now;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "etcd credentials changed but cannot be used yet")
                }
            }
        }
        self.client.clone()
    }
}

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
