//! Azurite's blob service on a loopback port, killed on drop: with shared keys over http, or
//! over https accepting only bearer tokens (`--oauth basic`), which it checks as Azure
//! Storage does except for the signature: a JWT for the storage audience, from an Entra ID
//! issuer, within its lifetime.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::free_port;

/// The emulator's well-known account and key.
pub const ACCOUNT: &str = "devstoreaccount1";
const ACCOUNT_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

pub struct Azurite {
    child: Child,
    port: u16,
    https: bool,
    _dir: tempfile::TempDir,
}

impl Azurite {
    /// Shared keys over http.
    pub fn start() -> Azurite {
        Azurite::spawn(&[], false)
    }

    /// Over https with this certificate and key, taking bearer tokens (and keys).
    pub fn start_oauth(cert: &Path, key: &Path) -> Azurite {
        let (cert, key) = (cert.display().to_string(), key.display().to_string());
        Azurite::spawn(&["--oauth", "basic", "--cert", &cert, "--key", &key], true)
    }

    fn spawn(extra: &[&str], https: bool) -> Azurite {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let child = Command::new("azurite-blob")
            .args(["--blobHost", "127.0.0.1", "--blobPort", &port.to_string()])
            .arg("--location")
            .arg(dir.path())
            .args([
                "--skipApiVersionCheck",
                "--loose",
                "--silent",
                "--disableTelemetry",
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run azurite-blob ({e}): install it with `npm install -g azurite`")
            });
        let server = Azurite {
            child,
            port,
            https,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "azurite did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    pub fn endpoint(&self) -> String {
        let scheme = if self.https { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// Creates a container with a SharedKey-signed request (object_store cannot).
    pub async fn create_container(&self, name: &str) {
        self.create_container_with(name, &reqwest::Client::new())
            .await;
    }

    /// Creates a container through `client` (one that trusts the https certificate).
    pub async fn create_container_with(&self, name: &str, client: &reqwest::Client) {
        use object_store::azure::{AzureAccessKey, AzureAuthorizer, AzureCredential};
        use object_store::client::{HttpRequest, HttpRequestBody};
        let url = format!("{}/{ACCOUNT}/{name}?restype=container", self.endpoint());
        let mut req = HttpRequest::new(HttpRequestBody::empty());
        *req.method_mut() = "PUT".parse().unwrap();
        *req.uri_mut() = url.parse().unwrap();
        req.headers_mut().insert(
            "content-length",
            object_store::HeaderValue::from_static("0"),
        );
        let key = AzureCredential::AccessKey(AzureAccessKey::try_new(ACCOUNT_KEY).unwrap());
        AzureAuthorizer::new(&key, ACCOUNT)
            .try_authorize(&mut req)
            .unwrap();
        let resp = client
            .put(&url)
            .headers(req.headers().clone())
            .send()
            .await
            .unwrap();
        assert!(
            resp.status().is_success(),
            "create container: {}",
            resp.status()
        );
    }
}

impl Drop for Azurite {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
