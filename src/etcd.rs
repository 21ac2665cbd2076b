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
