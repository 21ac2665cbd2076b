//! One streamed `PUT` of an object whose length is known, for S3.
//!
//! `object_store` uploads a stream only as a multipart upload: every part is buffered whole (S3's
//! minimum is 5 MiB) and the service assembles the parts when the upload completes, which on
//! many S3 implementations means writing every byte a second time. When the length is known in
//! advance (the copy job lists it), one `PUT` with a `Content-Length` can stream the body
//! straight through instead: memory stays at a few chunks and the service writes once. The
//! request goes to a URL presigned with the store's own credentials ([`Signer`]), so signing,
//! credential refresh and addressing stay `object_store`'s.
//!
//! With server-side encryption (SSE-S3, SSE-KMS, SSE-C) the request carries its headers, which
//! a presigned URL cannot: it is then signed with its headers (SigV4, payload unsigned) by the
//! store's own credentials instead, the URL still the store's addressing.
//!
//! Nothing partial becomes visible: S3 stores an object only after receiving exactly
//! `Content-Length` bytes, so a body that fails (an error item from the stream, which the copy
//! job's hash check sends instead of the payload's last chunk) or falls short leaves no object.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey, AwsAuthorizer};
use object_store::client::{HttpRequest, HttpRequestBody};
use object_store::path::Path;
use object_store::signer::{Method, Signer};

use super::{BuildError, ByteStream, StoreError};

/// S3's limit for one `PUT`.
const S3_PUT_MAX: u64 = 5 << 30;
/// Objects up to this size go in one `PUT`; larger ones in a multipart upload, whose parts are
/// retried one by one (a failed single `PUT` is resent whole by the next attempt).
pub const DEFAULT_LIMIT: u64 = 1 << 30;
/// How long a presigned URL stays valid; S3 checks it when the request starts.
const URL_LIFETIME: Duration = Duration::from_secs(3600);
/// As `object_store`'s default.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Streams objects of known length in one `PUT`.
#[derive(Clone)]
pub struct SinglePut {
    store: Arc<AmazonS3>,
    http: reqwest::Client,
    limit: u64,
    /// Server-side encryption headers every upload carries (signed with the request).
    encryption: reqwest::header::HeaderMap,
    /// The region requests are signed for.
    region: String,
}

impl std::fmt::Debug for SinglePut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SinglePut")
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

impl SinglePut {
    /// For an S3 store built by `builder`, unless its configuration asks for what this plain
    /// client does not carry (requester pays, checksums, anonymous access, a proxy): those
    /// stores keep uploading through `object_store`. Server-side encryption is carried.
    pub fn for_s3(
        builder: &AmazonS3Builder,
        ca_file: Option<&std::path::Path>,
    ) -> Result<Option<SinglePut>, BuildError> {
        const KEYS: [&str; 4] = [
            "aws_request_payer",
            "aws_checksum_algorithm",
            "aws_skip_signature",
            "aws_proxy_url",
        ];
        let set = |key: &str| {
            key.parse::<AmazonS3ConfigKey>()
                .ok()
                .and_then(|k| builder.get_config_value(&k))
                .is_some_and(|v| !v.is_empty() && v != "false")
        };
        if KEYS.into_iter().any(set) {
            return Ok(None);
        }
        let value = |key: &str| {
            key.parse::<AmazonS3ConfigKey>()
                .ok()
                .and_then(|k| builder.get_config_value(&k))
                .filter(|v| !v.is_empty())
        };
        let encryption = encryption_headers(&value)?;
        let region = value("aws_region").unwrap_or_else(|| "us-east-1".to_string());
        let store = Arc::new(builder.clone().build()?);
        let insecure = set("aws_allow_invalid_certificates");
        // No overall timeout: a 1 GiB body takes as long as the network needs. A dead peer is
        // found by TCP keepalive; a stalled copy by the Job's activeDeadlineSeconds.
        let http = trusting(
            reqwest::Client::builder()
                .connect_timeout(CONNECT_TIMEOUT)
                .tcp_keepalive(Duration::from_secs(30))
                .danger_accept_invalid_certs(insecure),
            ca_file,
        )?
        .build()?;
        Ok(Some(SinglePut {
            store,
            http,
            limit: DEFAULT_LIMIT,
            encryption,
            region,
        }))
    }

    /// Objects up to `limit` bytes (at most S3's 5 GiB) go in one `PUT`.
    pub fn with_limit(mut self, limit: u64) -> SinglePut {
        self.limit = limit.min(S3_PUT_MAX);
        self
    }

    /// Whether an object of `len` bytes goes in one `PUT`.
    pub fn takes(&self, len: u64) -> bool {
        len <= self.limit
    }

    /// Uploads exactly `len` bytes of `data` to `path`. An error item in `data` aborts the
    /// request and comes back as [`StoreError::Payload`].
    pub async fn put(&self, path: &Path, len: u64, data: ByteStream) -> Result<(), StoreError> {
        let url = self
            .store
            .signed_url(Method::PUT, path, URL_LIFETIME)
            .await?;
        let (url, headers) = if self.encryption.is_empty() {
            (url, reqwest::header::HeaderMap::new())
        } else {
            self.signed_with_headers(url).await?
        };
        let payload_error: Arc<Mutex<Option<std::io::Error>>> = Arc::default();
        let seen = payload_error.clone();
        let body = exactly(len, data).map(move |item| {
            item.map_err(|e| {
                let kind = e.kind();
                let message = e.to_string();
                *seen.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                std::io::Error::new(kind, message)
            })
        });
        let sent = self
            .http
            .put(url)
            .headers(headers)
            .header(reqwest::header::CONTENT_LENGTH, len)
            .body(reqwest::Body::wrap_stream(body))
            .send()
            .await;
        if let Some(e) = payload_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            return Err(StoreError::Payload(e));
        }
        let failed = |message: String| {
            StoreError::Backend(object_store::Error::Generic {
                store: "S3",
                source: format!("PUT {path}: {message}").into(),
            })
        };
        let response = sent.map_err(|e| failed(error_chain(&e)))?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let text = response.text().await.unwrap_or_default();
        Err(failed(format!("{status}: {}", text.trim())))
    }
}

impl SinglePut {
    /// The object's URL (a presigned one without its signature) and the headers of a request
    /// signed with the encryption headers among them.
    async fn signed_with_headers(
        &self,
        presigned: url::Url,
    ) -> Result<(url::Url, reqwest::header::HeaderMap), StoreError> {
        let mut url = presigned;
        url.set_query(None);
        let credential = self.store.credentials().get_credential().await?;
        let mut request = HttpRequest::new(HttpRequestBody::empty());
        *request.method_mut() = Method::PUT;
        *request.uri_mut() = url.as_str().parse().map_err(|e| {
            StoreError::Backend(object_store::Error::Generic {
                store: "S3",
                source: format!("the object's URL {url}: {e}").into(),
            })
        })?;
        *request.headers_mut() = self.encryption.clone();
        AwsAuthorizer::new(&credential, "s3", &self.region)
            .with_sign_payload(false)
            .try_authorize(&mut request, None)?;
        Ok((url, request.headers().clone()))
    }
}

/// The server-side encryption headers of a store's configuration (object_store's names), as
/// S3 takes them on a `PUT`.
pub(super) fn encryption_headers(
    value: &dyn Fn(&str) -> Option<String>,
) -> Result<reqwest::header::HeaderMap, BuildError> {
    use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
    let mut headers = HeaderMap::new();
    let mut set = |name: &'static str, v: &str| -> Result<(), BuildError> {
        let v =
            HeaderValue::from_str(v).map_err(|e| BuildError::Encryption(format!("{name}: {e}")))?;
        headers.insert(HeaderName::from_static(name), v);
        Ok(())
    };
    match value("aws_server_side_encryption").as_deref() {
        None => {}
        Some("sse-c") => {
            use base64::Engine as _;
            use md5::Digest as _;
            let b64 = base64::engine::general_purpose::STANDARD;
            let key = value("aws_sse_customer_key_base64")
                .ok_or_else(|| BuildError::Encryption("sse-c without a customer key".into()))?;
            let raw = b64
                .decode(&key)
                .map_err(|e| BuildError::Encryption(format!("the customer key: {e}")))?;
            set("x-amz-server-side-encryption-customer-algorithm", "AES256")?;
            set("x-amz-server-side-encryption-customer-key", &key)?;
            set(
                "x-amz-server-side-encryption-customer-key-md5",
                &b64.encode(md5::Md5::digest(&raw)),
            )?;
        }
        Some(algorithm) => {
            set("x-amz-server-side-encryption", algorithm)?;
            if let Some(id) = value("aws_sse_kms_key_id") {
                set("x-amz-server-side-encryption-aws-kms-key-id", &id)?;
            }
            if let Some(enabled) = value("aws_sse_bucket_key_enabled") {
                set("x-amz-server-side-encryption-bucket-key-enabled", &enabled)?;
            }
        }
    }
    Ok(headers)
}

/// `http` trusting the CA file `ca_file` (PEM) besides the system's roots, as the store's own
/// client does.
pub(super) fn trusting(
    http: reqwest::ClientBuilder,
    ca_file: Option<&std::path::Path>,
) -> Result<reqwest::ClientBuilder, BuildError> {
    let Some(path) = ca_file else {
        return Ok(http);
    };
    let ca_err = |message: String| BuildError::Ca {
        path: path.to_path_buf(),
        message,
    };
    let pem = std::fs::read(path).map_err(|e| ca_err(e.to_string()))?;
    let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| ca_err(e.to_string()))?;
    Ok(http.tls_certs_merge(certs))
}

/// `data`, checked to be exactly `len` bytes without ever passing on all `len` of them before
/// the end is seen: the latest chunk is held back until the next one arrives or the stream ends.
/// A server reads `Content-Length` bytes and stores them, so a body that is too long must fail
/// before its first `len` bytes are out, not after.
fn exactly(len: u64, data: ByteStream) -> ByteStream {
    struct State {
        data: ByteStream,
        len: u64,
        seen: u64,
        held: Option<Bytes>,
        done: bool,
    }
    let mismatch = |what: &str, len: u64| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("the payload is {what} than the {len} bytes announced for it"),
        )
    };
    let state = State {
        data,
        len,
        seen: 0,
        held: None,
        done: false,
    };
    futures::stream::unfold(state, move |mut st| async move {
        if st.done {
            return None;
        }
        loop {
            match st.data.next().await {
                Some(Ok(chunk)) if chunk.is_empty() => {}
                Some(Ok(chunk)) => {
                    st.seen += chunk.len() as u64;
                    if st.seen > st.len {
                        st.done = true;
                        return Some((Err(mismatch("longer", st.len)), st));
                    }
                    if let Some(previous) = st.held.replace(chunk) {
                        return Some((Ok(previous), st));
                    }
                }
                Some(Err(e)) => {
                    st.done = true;
                    return Some((Err(e), st));
                }
                None => {
                    st.done = true;
                    if st.seen < st.len {
                        return Some((Err(mismatch("shorter", st.len)), st));
                    }
                    return st.held.take().map(|last| (Ok(last), st));
                }
            }
        }
    })
    .boxed()
}

/// An error and its sources, `: `-separated (reqwest's own message names only the outer layer).
pub(super) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn builder() -> AmazonS3Builder {
        AmazonS3Builder::new()
            .with_bucket_name("bkt")
            .with_region("us-east-1")
            .with_endpoint("http://127.0.0.1:1")
            .with_allow_http(true)
            .with_access_key_id("id")
            .with_secret_access_key("secret")
    }

    #[test]
    fn stores_that_need_what_a_put_cannot_carry_keep_multipart() {
        assert!(SinglePut::for_s3(&builder(), None).unwrap().is_some());
        let with = |key: &str, value: &str| builder().with_config(key.parse().unwrap(), value);
        for (key, value) in [
            ("aws_request_payer", "true"),
            ("aws_checksum_algorithm", "sha256"),
            ("aws_skip_signature", "true"),
            ("aws_proxy_url", "http://proxy:3128"),
        ] {
            let got = SinglePut::for_s3(&with(key, value), None).unwrap();
            assert!(got.is_none(), "{key}={value} must keep multipart");
        }
        for (key, value) in [
            ("aws_request_payer", "false"),
            ("aws_allow_invalid_certificates", "true"),
            ("aws_server_side_encryption", "aws:kms"),
        ] {
            let got = SinglePut::for_s3(&with(key, value), None).unwrap();
            assert!(got.is_some(), "{key}={value} keeps single PUTs");
        }
    }

    async fn run(len: u64, chunks: &[&[u8]]) -> (usize, Option<String>) {
        let items: Vec<std::io::Result<Bytes>> = chunks
            .iter()
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let mut out = exactly(len, futures::stream::iter(items).boxed());
        let mut passed = 0;
        while let Some(item) = out.next().await {
            match item {
                Ok(b) => passed += b.len(),
                Err(e) => return (passed, Some(e.to_string())),
            }
        }
        (passed, None)
    }

    #[tokio::test]
    async fn a_body_of_the_wrong_length_fails_before_its_announced_length_is_out() {
        assert_eq!(run(6, &[b"abc", b"", b"def"]).await, (6, None));
        assert_eq!(run(0, &[]).await, (0, None));
        // Too long: the first 6 bytes would complete the request, so they never all pass.
        let (passed, e) = run(6, &[b"abc", b"def", b"g"]).await;
        assert!(passed < 6 && e.unwrap().contains("longer"));
        let (passed, e) = run(6, &[b"abcdef", b"g"]).await;
        assert!(passed < 6 && e.unwrap().contains("longer"));
        let (passed, e) = run(6, &[b"abc", b"defg"]).await;
        assert!(passed < 6 && e.unwrap().contains("longer"));
        let (passed, e) = run(6, &[b"abc"]).await;
        assert!(passed < 6 && e.unwrap().contains("shorter"));
    }

    #[test]
    fn the_limit_is_capped_at_s3s_single_put_maximum() {
        let p = SinglePut::for_s3(&builder(), None).unwrap().unwrap();
        assert!(p.takes(DEFAULT_LIMIT) && !p.takes(DEFAULT_LIMIT + 1));
        let p = p.with_limit(u64::MAX);
        assert!(p.takes(S3_PUT_MAX) && !p.takes(S3_PUT_MAX + 1));
    }
}
