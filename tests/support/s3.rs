//! A real S3-compatible server (`s3s-fs`) on loopback, with buckets as folders of a temp dir.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use etcd_warden::config::{Secret, StoreConfig, StoreLocation};
use object_store::aws::{AmazonS3, AmazonS3Builder};

use super::{free_port, on_path, require_bin, wait_for_port};

pub const ACCESS_KEY: &str = "warden-test-access";
pub const SECRET_KEY: &str = "warden-test-secret-key";
pub const REGION: &str = "us-east-1";

/// This server's account, as [`S3Account`].
pub const ACCOUNT: S3Account = S3Account {
    region: REGION,
    access_key: ACCESS_KEY,
    secret_key: SECRET_KEY,
};

/// The region and keys a test's S3-compatible server accepts (s3s-fs here, moto in
/// [`super::moto`]), and the three ways a test hands them on: one place for how tests reach such
/// a server at an endpoint.
pub struct S3Account {
    pub region: &'static str,
    pub access_key: &'static str,
    pub secret_key: &'static str,
}

impl S3Account {
    /// An object_store client for `bucket` at `endpoint` (path-style, plain HTTP).
    pub fn client(&self, endpoint: &str, bucket: &str) -> AmazonS3 {
        AmazonS3Builder::new()
            .with_endpoint(endpoint)
            .with_allow_http(true)
            .with_virtual_hosted_style_request(false)
            .with_region(self.region)
            .with_bucket_name(bucket)
            .with_access_key_id(self.access_key)
            .with_secret_access_key(self.secret_key)
            .build()
            .expect("build S3 client")
    }

    /// Configuration overrides (dotted key, value) pointing `section` (`store`, …) at `bucket`
    /// and `prefix` through `endpoint`.
    pub fn config_overrides(
        &self,
        section: &str,
        endpoint: &str,
        bucket: &str,
        prefix: &str,
    ) -> Vec<(String, String)> {
        vec![
            (format!("{section}.url"), format!("s3://{bucket}/{prefix}")),
            (format!("{section}.endpoint"), endpoint.to_string()),
            (format!("{section}.region"), self.region.to_string()),
            (
                format!("{section}.access_key_id"),
                self.access_key.to_string(),
            ),
            (
                format!("{section}.secret_access_key"),
                self.secret_key.to_string(),
            ),
        ]
    }

    /// A `[store]` configuration for `bucket` and `prefix` at `endpoint`.
    pub fn store_config(&self, endpoint: &str, bucket: &str, prefix: &str) -> StoreConfig {
        let location = StoreLocation::parse(&format!("s3://{bucket}/{prefix}")).unwrap();
        StoreConfig {
            endpoint: Some(endpoint.to_string()),
            region: Some(self.region.into()),
            allow_http: true,
            access_key_id: Some(Secret::Value(self.access_key.into())),
            secret_access_key: Some(Secret::Value(self.secret_key.into())),
            ..StoreConfig::at(location)
        }
    }
}

/// One `s3s-fs` process.
pub struct S3Server {
    pub root: tempfile::TempDir,
    pub port: u16,
    child: Option<Child>,
    bin: PathBuf,
}

fn s3s_fs_bin() -> PathBuf {
    let mut candidates = Vec::new();
    if let Some(p) = std::env::var_os("WARDEN_TEST_S3S_FS") {
        candidates.push(PathBuf::from(p));
    }
    // examples/s3s_fs.rs, which `cargo test` builds beside this test binary
    // (target/<profile>/deps/it-… → target/<profile>/examples/s3s_fs).
    if let Some(profile_dir) = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.to_path_buf()))
    {
        candidates.push(profile_dir.join("examples/s3s_fs"));
    }
    if let Some(home) = std::env::var_os("CARGO_HOME")
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo").into()))
    {
        candidates.push(PathBuf::from(home).join("bin/s3s-fs"));
    }
    candidates.extend(on_path("s3s-fs"));
    require_bin(
        "s3s-fs",
        &candidates,
        "cargo build --example s3s_fs (cargo test builds it too)",
    )
}

impl S3Server {
    /// Starts the server with these buckets (names of 3 characters or more).
    pub fn start(buckets: &[&str]) -> S3Server {
        let root = tempfile::tempdir().expect("temp dir");
        for b in buckets {
            assert!(
                b.len() >= 3,
                "s3s-fs rejects bucket names shorter than 3 characters: {b:?}"
            );
            std::fs::create_dir_all(root.path().join(b)).expect("create bucket dir");
        }
        let mut s = S3Server {
            root,
            port: free_port(),
            child: None,
            bin: s3s_fs_bin(),
        };
        s.resume();
        s
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Stops the process (the data stays): an outage.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the process again on the same port and data.
    pub fn resume(&mut self) {
        assert!(self.child.is_none(), "s3s-fs already running");
        let child = Command::new(&self.bin)
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(self.root.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn s3s-fs");
        self.child = Some(child);
        let addr: SocketAddr = ([127, 0, 0, 1], self.port).into();
        assert!(
            wait_for_port(addr, Duration::from_secs(10)),
            "s3s-fs did not listen on {addr}"
        );
    }

    /// Stops the server and starts it again, same data, on a new port: clients configured
    /// with the old endpoint find nothing there any more (a partition from the store), clients
    /// configured afterwards ([`S3Server::endpoint`]) reach the same buckets.
    pub fn move_port(&mut self) {
        self.stop();
        self.port = free_port();
        self.resume();
    }

    /// An object_store client for one bucket.
    pub fn object_store(&self, bucket: &str) -> Arc<AmazonS3> {
        Arc::new(ACCOUNT.client(&self.endpoint(), bucket))
    }

    /// Configuration overrides (dotted key, value) pointing `section` (`store`, …) at a bucket.
    pub fn config_overrides(
        &self,
        section: &str,
        bucket: &str,
        prefix: &str,
    ) -> Vec<(String, String)> {
        ACCOUNT.config_overrides(section, &self.endpoint(), bucket, prefix)
    }

    /// The server's endpoint, region and keys for the configuration section `section` as the
    /// binary's environment variables (`ETCD_WARDEN_STORE_ENDPOINT`, …); the URL is left out.
    pub fn env(&self, section: &str) -> Vec<(String, String)> {
        let keys = self.config_overrides(section, "", "");
        keys.into_iter()
            .filter(|(key, _)| !key.ends_with(".url"))
            .map(|(key, value)| (etcd_warden::config::env_var_for(&key), value))
            .collect()
    }

    /// A `[store]` configuration for `bucket` and `prefix` of this server.
    pub fn store_config(&self, bucket: &str, prefix: &str) -> StoreConfig {
        ACCOUNT.store_config(&self.endpoint(), bucket, prefix)
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}
