//! moto's S3 in server mode (`moto_server`, PyPI `moto[server]`) on loopback: the local S3 that
//! implements Object Lock (versioned buckets, retention, legal holds, refused version deletes).
//!
//! moto takes any credentials and checks no signature's validity, but answers an unsigned request
//! on an object 403 (anonymous access): the requests made here are presigned by `object_store`,
//! as etcd-warden's own are, or carry [`ANY_SIGNATURE`]. It also records what s3s-fs ignores,
//! server-side encryption headers, but encrypts nothing, accepts any KMS key id and does not
//! enforce SSE-C (an object written with a customer key reads back without it).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use etcd_warden::config::StoreConfig;
use object_store::aws::AmazonS3;
use object_store::path::Path;
use object_store::signer::{Method, SignedUrlOptions, Signer};

use super::s3::S3Account;
use super::{free_port, on_path, require_bin, wait_for_port};

pub const REGION: &str = "us-east-1";
const ACCESS_KEY: &str = "moto-access";
const SECRET_KEY: &str = "moto-secret";

/// moto's account, as [`S3Account`]: its `config_overrides` point a section at a bucket through
/// any endpoint (moto's own, or a proxy in front of it).
pub const ACCOUNT: S3Account = S3Account {
    region: REGION,
    access_key: ACCESS_KEY,
    secret_key: SECRET_KEY,
};
/// An `Authorization` header moto accepts on a request the test makes itself (it checks no
/// signature).
pub const ANY_SIGNATURE: &str = "AWS4-HMAC-SHA256 Credential=moto-access/20260101/us-east-1/s3/\
                                 aws4_request, SignedHeaders=host, Signature=0";

/// One `moto_server` process, killed on drop.
pub struct MotoServer {
    pub port: u16,
    child: Child,
}

fn moto_server_bin() -> PathBuf {
    let mut candidates = Vec::new();
    if let Some(p) = std::env::var_os("WARDEN_TEST_MOTO_SERVER") {
        candidates.push(PathBuf::from(p));
    }
    candidates.extend(on_path("moto_server"));
    require_bin(
        "moto_server",
        &candidates,
        "python3 -m pip install 'moto[server]'",
    )
}

impl MotoServer {
    /// Starts the server on a free loopback port.
    pub fn start() -> MotoServer {
        let port = free_port();
        let child = Command::new(moto_server_bin())
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn moto_server");
        let server = MotoServer { port, child };
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        // A Python server: importing moto takes a few seconds.
        assert!(
            wait_for_port(addr, Duration::from_secs(60)),
            "moto_server did not listen on {addr}"
        );
        server
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn client(&self, bucket: &str) -> AmazonS3 {
        ACCOUNT.client(&self.endpoint(), bucket)
    }

    /// A URL of `bucket` for `method` on `key` with `query`, presigned.
    async fn signed(
        &self,
        bucket: &str,
        method: Method,
        key: &str,
        query: &[(&str, &str)],
    ) -> String {
        let options = SignedUrlOptions::new().with_query(query.iter().copied());
        self.client(bucket)
            .signed_url_opts(method, &Path::from(key), Duration::from_secs(300), &options)
            .await
            .expect("presign")
            .to_string()
    }

    /// Starts the server with these (plain) buckets.
    pub async fn with_buckets(buckets: &[&str]) -> MotoServer {
        let moto = MotoServer::start();
        for b in buckets {
            let r = moto.request(reqwest::Method::PUT, &format!("/{b}")).await;
            assert!(r.status().is_success(), "create bucket {b}: {}", r.status());
        }
        moto
    }

    /// A request of the test's own (`path` with its query), with [`ANY_SIGNATURE`].
    pub async fn request(&self, method: reqwest::Method, path: &str) -> reqwest::Response {
        reqwest::Client::new()
            .request(method, format!("{}{path}", self.endpoint()))
            .header("authorization", ANY_SIGNATURE)
            .send()
            .await
            .expect("moto answers")
    }

    /// Creates a bucket with Object Lock enabled (which makes it versioned, as on AWS).
    pub async fn create_locked_bucket(&self, bucket: &str) {
        let r = reqwest::Client::new()
            .put(format!("{}/{bucket}", self.endpoint()))
            .header("x-amz-bucket-object-lock-enabled", "true")
            .send()
            .await
            .expect("create bucket");
        assert!(r.status().is_success(), "create bucket: {}", r.status());
    }

    /// Turns the legal hold of the current version of `key` on or off.
    pub async fn legal_hold(&self, bucket: &str, key: &str, on: bool) {
        let status = if on { "ON" } else { "OFF" };
        let body = format!(
            "<LegalHold xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Status>{status}</Status></LegalHold>"
        );
        let r = reqwest::Client::new()
            .put(
                self.signed(bucket, Method::PUT, key, &[("legal-hold", "")])
                    .await,
            )
            .body(body)
            .send()
            .await
            .expect("put legal hold");
        assert!(r.status().is_success(), "legal hold: {}", r.status());
    }

    /// The version ids of `key` (current and noncurrent) and whether a delete marker hides it.
    pub async fn versions(&self, bucket: &str, key: &str) -> (usize, bool) {
        let r = reqwest::Client::new()
            .get(
                self.signed(
                    bucket,
                    Method::GET,
                    "",
                    &[("versions", ""), ("prefix", key)],
                )
                .await,
            )
            .send()
            .await
            .expect("list versions");
        let text = r.text().await.expect("list versions body");
        (
            text.matches("<Version>").count(),
            text.contains("<DeleteMarker>"),
        )
    }

    /// A `[store]` configuration for `bucket` and `prefix` of this server.
    pub fn store_config(&self, bucket: &str, prefix: &str) -> StoreConfig {
        ACCOUNT.store_config(&self.endpoint(), bucket, prefix)
    }
}

impl Drop for MotoServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
