//! moto's S3 server (`moto_server`, PyPI `moto[server]`) on loopback: a second S3 that records
//! what the first (s3s-fs) ignores, such as server-side encryption headers. moto checks no
//! signature (any credentials are accepted), encrypts nothing and does not enforce SSE-C (an
//! object written with a customer key reads back without it); its KMS accepts any key id. Tests
//! say which of these they rely on.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{free_port, on_path, require_bin, wait_for_port};

/// What moto takes as credentials: anything signed.
pub const ACCESS_KEY: &str = "moto-access";
pub const SECRET_KEY: &str = "moto-secret";
pub const REGION: &str = "us-east-1";
/// An `Authorization` header moto accepts for a request the test makes itself (moto refuses
/// anonymous object reads, and checks no signature).
pub const ANY_SIGNATURE: &str = "AWS4-HMAC-SHA256 Credential=moto-access/20260101/us-east-1/s3/\
                                 aws4_request, SignedHeaders=host, Signature=0";

/// One `moto_server` process, killed on drop.
pub struct Moto {
    child: Child,
    pub port: u16,
}

impl Moto {
    /// Starts the server and creates these buckets.
    pub async fn start(buckets: &[&str]) -> Moto {
        let bin = require_bin(
            "moto_server",
            &on_path("moto_server").into_iter().collect::<Vec<_>>(),
            "python3 -m pip install 'moto[server]'",
        );
        let port = free_port();
        let child = Command::new(bin)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn moto_server");
        let moto = Moto { child, port };
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        assert!(
            wait_for_port(addr, Duration::from_secs(30)),
            "moto_server did not listen on {addr}"
        );
        for b in buckets {
            let r = moto.request(reqwest::Method::PUT, &format!("/{b}")).await;
            assert!(r.status().is_success(), "create bucket {b}: {}", r.status());
        }
        moto
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
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

    /// Configuration overrides (dotted key, value) pointing `section` at a bucket through
    /// `endpoint` (moto's own, or a proxy in front of it).
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
            (format!("{section}.region"), REGION.to_string()),
            (format!("{section}.access_key_id"), ACCESS_KEY.to_string()),
            (
                format!("{section}.secret_access_key"),
                SECRET_KEY.to_string(),
            ),
        ]
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
