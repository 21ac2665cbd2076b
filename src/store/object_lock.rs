//! Objects the store keeps under retention: S3 Object Lock written on each new snapshot, and the
//! lock read (or the store's refusal recognised) before retention deletes one.
//!
//! `object_store` sends no per-request headers, so neither the lock headers of an upload nor
//! S3's lock subresources are reachable through it. Both go as requests presigned with the
//! store's own credentials (as [`super::single_put`] does), so signing, credential refresh and
//! addressing stay `object_store`'s:
//! - writing: `PutObjectRetention` (`PUT ?retention`) right after the upload completes, whichever
//!   path uploaded it (multipart, single `PUT`, a delta's `PUT`). An upload with the lock headers
//!   would need a `Content-MD5` of the body (S3's rule for locked writes), which a streamed
//!   snapshot does not have before its last byte; the small retention request has one.
//! - reading: `HEAD`, whose `x-amz-object-lock-retain-until-date` and
//!   `x-amz-object-lock-legal-hold` headers S3 returns to a caller allowed
//!   `s3:GetObjectRetention` and `s3:GetObjectLegalHold`.
//!
//! Why read before deleting: Object Lock needs a versioned bucket, where a `DELETE` without a
//! version succeeds by adding a delete marker. A locked snapshot would vanish from the listing
//! (no restore finds it) while its data stays, locked, in a noncurrent version. Retention skips
//! a locked snapshot instead, so the listing stays truthful and the chain restorable.
//!
//! GCS retention policies and holds, and Azure immutability policies and legal holds, are set on
//! the bucket or container, not per object by etcd-warden; their refusal of a delete is
//! recognised by [`is_lock_refusal`].

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, TimeDelta, Utc};
use md5::Digest;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path;
use object_store::signer::{HeaderName, HeaderValue, Method, SignedUrlOptions, Signer};

use super::{BuildError, StoreError};
use crate::config::ObjectLockRetention;

/// How long a presigned URL stays valid: it is used at once.
const URL_LIFETIME: Duration = Duration::from_secs(300);
/// A retention or lock request carries a few hundred bytes; S3 answers at once.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// As `object_store`'s default.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the store keeps an object for now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lock {
    /// The retention date, when one is set and not yet passed.
    pub retain_until: Option<DateTime<Utc>>,
    /// Whether a legal hold is on (it has no date: it stays until someone lifts it).
    pub legal_hold: bool,
    /// What the store said when it refused a delete (GCS, Azure), when that is how it is known.
    pub refusal: Option<String>,
}

impl std::fmt::Display for Lock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if let Some(until) = self.retain_until {
            parts.push(format!(
                "retained until {}",
                until.to_rfc3339_opts(SecondsFormat::Secs, true)
            ));
        }
        if self.legal_hold {
            parts.push("under legal hold".to_string());
        }
        if let Some(r) = &self.refusal {
            parts.push(format!("the store refused the delete: {r}"));
        }
        write!(f, "{}", parts.join(", "))
    }
}

/// S3 Object Lock for one S3 store: the retention of new snapshots, and reading a lock.
#[derive(Clone)]
pub struct S3ObjectLock {
    signer: Arc<AmazonS3>,
    http: reqwest::Client,
    retention: Option<ObjectLockRetention>,
    /// Headers a read of an object needs (SSE-C's key), signed with the `HEAD`.
    read_headers: reqwest::header::HeaderMap,
}

impl std::fmt::Debug for S3ObjectLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3ObjectLock")
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

impl S3ObjectLock {
    /// For an S3 store built by `builder`; `retention` is what new snapshots get (none: locks
    /// are only read). The requests trust `ca_file` (the store's `ca_file`) and go through the
    /// store's proxy, as the store's own do.
    pub fn for_s3(
        builder: &AmazonS3Builder,
        retention: Option<ObjectLockRetention>,
        ca_file: Option<&std::path::Path>,
    ) -> Result<S3ObjectLock, BuildError> {
        let value = |key: &str| {
            key.parse::<object_store::aws::AmazonS3ConfigKey>()
                .ok()
                .and_then(|k| builder.get_config_value(&k))
                .filter(|v| !v.is_empty())
        };
        let insecure = value("aws_allow_invalid_certificates").is_some_and(|v| v == "true");
        let mut http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            .danger_accept_invalid_certs(insecure);
        http = super::single_put::trusting(http, ca_file)?;
        if let Some(proxy) = value("aws_proxy_url") {
            http = http.proxy(reqwest::Proxy::all(proxy)?);
        }
        // SSE-C: a HEAD of an object written with a customer key needs the key.
        let read_headers: reqwest::header::HeaderMap =
            super::single_put::encryption_headers(&value)?
                .into_iter()
                .filter_map(|(name, v)| {
                    name.filter(|n| n.as_str().contains("-customer-"))
                        .map(|n| (n, v))
                })
                .collect();
        Ok(S3ObjectLock {
            signer: Arc::new(builder.clone().build()?),
            http: http.build()?,
            retention,
            read_headers,
        })
    }

    /// Whether new snapshots are retained.
    pub fn retains(&self) -> bool {
        self.retention.is_some()
    }

    /// Puts the configured retention on the object at `path`, counted from `now`
    /// (`PutObjectRetention`). Without a configured retention, nothing.
    pub async fn retain(&self, path: &Path, now: DateTime<Utc>) -> Result<(), StoreError> {
        let Some(retention) = self.retention else {
            return Ok(());
        };
        let until = retain_until(now, retention.period);
        let body = retention_xml(retention.mode.as_s3(), until);
        let md5 = base64::Engine::encode(
            &base64::engine::general_purpose::STANDARD,
            md5::Md5::digest(body.as_bytes()),
        );
        let failed = |message: String| failure("PUT ?retention", path, message);
        let md5_value = HeaderValue::from_str(&md5).map_err(|e| failed(e.to_string()))?;
        let options = SignedUrlOptions::new()
            .with_query([("retention", "")])
            .with_signed_header(HeaderName::from_static("content-md5"), md5_value);
        let url = self
            .signer
            .signed_url_opts(Method::PUT, path, URL_LIFETIME, &options)
            .await?;
        let response = self
            .http
            .put(url)
            .header("content-md5", md5)
            .header(reqwest::header::CONTENT_TYPE, "application/xml")
            .body(body)
            .send()
            .await
            .map_err(|e| failed(super::single_put::error_chain(&e)))?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let text = response.text().await.unwrap_or_default();
        Err(failed(format!("{status}: {}", text.trim())))
    }

    /// The lock on the object at `path` as of `now`, read from a `HEAD`; `None` when it is not
    /// locked (or is gone).
    pub async fn lock_of(
        &self,
        path: &Path,
        now: DateTime<Utc>,
    ) -> Result<Option<Lock>, StoreError> {
        let options = self
            .read_headers
            .iter()
            .fold(SignedUrlOptions::new(), |o, (name, value)| {
                o.with_signed_header(name.clone(), value.clone())
            });
        let url = self
            .signer
            .signed_url_opts(Method::HEAD, path, URL_LIFETIME, &options)
            .await?;
        let response = self
            .http
            .head(url)
            .headers(self.read_headers.clone())
            .send()
            .await
            .map_err(|e| failure("HEAD", path, super::single_put::error_chain(&e)))?;
        let status = response.status();
        if status == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !status.is_success() {
            return Err(failure("HEAD", path, status.to_string()));
        }
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        Ok(lock_from_headers(
            header("x-amz-object-lock-retain-until-date").as_deref(),
            header("x-amz-object-lock-legal-hold").as_deref(),
            now,
        ))
    }
}

fn failure(what: &str, path: &Path, message: String) -> StoreError {
    StoreError::Backend(object_store::Error::Generic {
        store: "S3",
        source: format!("{what} {path}: {message}").into(),
    })
}

/// `now + period`, whole seconds rounded up (a retention never ends early).
pub fn retain_until(now: DateTime<Utc>, period: Duration) -> DateTime<Utc> {
    let secs = i64::try_from(period.as_secs()).unwrap_or(i64::MAX / 2)
        + i64::from(period.subsec_nanos() > 0 || now.timestamp_subsec_nanos() > 0);
    let whole = DateTime::from_timestamp(now.timestamp(), 0).unwrap_or(now);
    whole + TimeDelta::try_seconds(secs).unwrap_or(TimeDelta::MAX / 2)
}

/// `PutObjectRetention`'s body.
fn retention_xml(mode: &str, until: DateTime<Utc>) -> String {
    format!(
        "<Retention xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Mode>{mode}</Mode>\
         <RetainUntilDate>{}</RetainUntilDate></Retention>",
        until.to_rfc3339_opts(SecondsFormat::Secs, true)
    )
}

/// The lock S3's `HEAD` headers describe as of `now`: a retention date still ahead, or a legal
/// hold that is on. A date that does not parse counts as a lock (the object is kept and the
/// next pass reads it again), never as none.
pub fn lock_from_headers(
    retain_until: Option<&str>,
    legal_hold: Option<&str>,
    now: DateTime<Utc>,
) -> Option<Lock> {
    let legal_hold = legal_hold.is_some_and(|v| v.trim().eq_ignore_ascii_case("ON"));
    let until = retain_until.map(|v| {
        DateTime::parse_from_rfc3339(v.trim())
            .map(|t| t.with_timezone(&Utc))
            .unwrap_or(DateTime::<Utc>::MAX_UTC)
    });
    let retain_until = until.filter(|t| *t > now);
    (legal_hold || retain_until.is_some()).then_some(Lock {
        retain_until,
        legal_hold,
        refusal: None,
    })
}

/// Whether a failed delete is the store refusing because the object is under retention or a
/// hold: S3 Object Lock's `AccessDenied` (a version's delete), Azure's immutability policy or
/// legal hold (`409 BlobImmutableDueToPolicy`, `…LegalHold`), GCS's retention policy
/// (`403 retentionPolicyNotMet`) or an event-based or temporary hold ("is under active … hold").
/// A plain permission or network failure is not.
pub fn is_lock_refusal(error: &object_store::Error) -> bool {
    const MARKERS: [&str; 8] = [
        "object lock",
        "objectlock",
        "immutab",
        "legalhold",
        "legal hold",
        "retentionpolicynotmet",
        "under active",
        "retention policy",
    ];
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(s) = source {
        text.push(' ');
        text.push_str(&s.to_string());
        source = s.source();
    }
    let text = text.to_ascii_lowercase();
    MARKERS.iter().any(|m| text.contains(m))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn a_lock_is_a_date_ahead_or_a_hold_that_is_on() {
        let now = t("2026-01-01T00:00:00Z");
        let ahead = Some("2026-01-02T00:00:00.5Z");
        let got = lock_from_headers(ahead, None, now).unwrap();
        assert_eq!(got.retain_until, Some(t("2026-01-02T00:00:00.5Z")));
        assert!(!got.legal_hold);
        assert_eq!(
            lock_from_headers(Some("2025-12-31T23:59:59Z"), None, now),
            None
        );
        assert_eq!(lock_from_headers(None, Some("OFF"), now), None);
        assert_eq!(lock_from_headers(None, None, now), None);
        let held = lock_from_headers(Some("2025-01-01T00:00:00Z"), Some("ON"), now).unwrap();
        assert!(held.legal_hold && held.retain_until.is_none());
        // An unreadable date keeps the object.
        assert!(lock_from_headers(Some("soon"), None, now).is_some());
        assert_eq!(
            held.to_string(),
            "under legal hold",
            "what the log line says"
        );
    }

    #[test]
    fn retention_ends_no_earlier_than_the_period() {
        let now = t("2026-01-01T00:00:00.250Z");
        assert_eq!(
            retain_until(now, Duration::from_secs(720 * 3600)),
            t("2026-01-31T00:00:01Z")
        );
        let whole = t("2026-01-01T00:00:00Z");
        assert_eq!(
            retain_until(whole, Duration::from_secs(5)),
            t("2026-01-01T00:00:05Z")
        );
        let xml = retention_xml("GOVERNANCE", t("2026-01-01T00:00:05Z"));
        assert!(xml.contains("<Mode>GOVERNANCE</Mode>"), "{xml}");
        assert!(
            xml.contains("<RetainUntilDate>2026-01-01T00:00:05Z</RetainUntilDate>"),
            "{xml}"
        );
    }

    #[test]
    fn the_requests_trust_the_stores_ca_and_use_its_proxy() {
        let builder = || {
            AmazonS3Builder::new()
                .with_bucket_name("bkt")
                .with_region("us-east-1")
                .with_endpoint("https://127.0.0.1:1")
                .with_access_key_id("id")
                .with_secret_access_key("secret")
        };
        assert!(S3ObjectLock::for_s3(&builder(), None, None).is_ok());
        let proxied = builder().with_proxy_url("http://127.0.0.1:3128");
        assert!(S3ObjectLock::for_s3(&proxied, None, None).is_ok());
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("ca.pem");
        let e = S3ObjectLock::for_s3(&builder(), None, Some(&missing)).unwrap_err();
        assert!(e.to_string().contains("ca.pem"), "{e}");
    }

    /// No local server enforces GCS or Azure retention (azurite accepts a delete of a blob under
    /// an immutability policy), so their refusals are recognised from the messages the services
    /// document, as `object_store` reports them.
    #[test]
    fn lock_refusals_are_told_from_other_failures() {
        let generic = |status: &str, body: &str| object_store::Error::Generic {
            store: "S3",
            source: format!("Server returned non-2xx status code: {status}: {body}").into(),
        };
        let denied = |body: &str| object_store::Error::PermissionDenied {
            path: "p/v2/Full-00000000-00000001-1".into(),
            source: format!("Server returned non-2xx status code: 403 Forbidden: {body}").into(),
        };
        let conflict = |body: &str| object_store::Error::AlreadyExists {
            path: "p/v2/Full-00000000-00000001-1".into(),
            source: format!("Server returned non-2xx status code: 409 Conflict: {body}").into(),
        };
        let locked = [
            // S3, deleting a version under retention.
            denied(
                "<Error><Code>AccessDenied</Code><Message>Access Denied because object protected \
                 by object lock.</Message></Error>",
            ),
            // Azure, a blob under a time-based immutability policy or a legal hold.
            conflict(
                "<Error><Code>BlobImmutableDueToPolicy</Code><Message>This operation is not \
                 permitted as the blob is immutable due to a policy.</Message></Error>",
            ),
            conflict("<Error><Code>BlobImmutableDueToLegalHold</Code></Error>"),
            // GCS, a retention policy not yet met, and an event-based hold.
            denied(
                r#"{"error":{"code":403,"errors":[{"reason":"retentionPolicyNotMet"}],"message":"Object 'p/v2/x' is subject to bucket's retention policy or object retention and cannot be deleted or overwritten until 2026-02-01"}}"#,
            ),
            generic(
                "403 Forbidden",
                "Object 'p/v2/x' is under active Event-Based hold and cannot be deleted",
            ),
        ];
        for e in &locked {
            assert!(is_lock_refusal(e), "locked: {e}");
        }
        let other = [
            denied("<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"),
            generic(
                "500 Internal Server Error",
                "We encountered an internal error",
            ),
            object_store::Error::NotFound {
                path: "p".into(),
                source: "gone".into(),
            },
        ];
        for e in &other {
            assert!(!is_lock_refusal(e), "not a lock: {e}");
        }
    }
}
