//! Store URLs: `file:///dir`, `memory://`, `s3://bucket/prefix`, `gs://bucket/prefix`,
//! `az://container/prefix`. Re-exported as `crate::store::StoreLocation`, where stores are built.

use std::fmt;
use std::path::PathBuf;

/// Where a store lives, parsed from its URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLocation {
    /// A local directory (the embedded default); the directory is the prefix.
    File { root: PathBuf },
    /// In process memory: tests and dry runs only.
    Memory { prefix: String },
    /// Amazon S3 or an S3-compatible service.
    S3 { bucket: String, prefix: String },
    /// Google Cloud Storage.
    Gcs { bucket: String, prefix: String },
    /// Azure Blob Storage.
    Azure { container: String, prefix: String },
}

/// Why a URL that holds a user name or password is refused: object_store would put it into
/// every request URL, so into every error message and log line that names one.
pub const CREDENTIALS_IN_URL: &str = "holds a user name or password, which is never taken from a \
     URL (it would be printed with every message naming it): give them in the store's \
     access_key_id and secret_access_key (or their _file forms), account_key, or the \
     provider's environment variables";

/// `text` with the user name and password of its URL (`scheme://user:pass@host/…`) replaced by
/// [`super::REDACTED`], as every message and printout shows a URL; other text unchanged. A
/// text the URL parser reads a user or password from but this cannot find is redacted whole.
pub fn redact_url(text: &str) -> String {
    if let Some(start) = text.find("://").map(|i| i + 3) {
        let rest = &text[start..];
        let end = rest.find(['/', '?', '#', '\\']).unwrap_or(rest.len());
        if let Some(at) = rest[..end].rfind('@') {
            return format!("{}{}{}", &text[..start], super::REDACTED, &rest[at..]);
        }
    }
    match url::Url::parse(text.trim()) {
        Ok(url) if has_userinfo(&url) => super::REDACTED.to_string(),
        _ => text.to_string(),
    }
}

/// Whether `url` carries a user name or a password.
pub fn has_userinfo(url: &url::Url) -> bool {
    !url.username().is_empty() || url.password().is_some()
}

/// Why a store URL was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{url:?}: {reason}")]
pub struct LocationError {
    url: String,
    reason: String,
}

impl StoreLocation {
    /// Parses a store URL.
    pub fn parse(text: &str) -> Result<StoreLocation, LocationError> {
        let fail = |reason: &str| LocationError {
            url: redact_url(text),
            reason: reason.to_string(),
        };
        let url = url::Url::parse(text.trim()).map_err(|e| {
            fail(&format!(
                "not a URL ({e}); write e.g. \"file:///var/backups/etcd\" or \"s3://bucket/prefix\""
            ))
        })?;
        if has_userinfo(&url) {
            return Err(fail(CREDENTIALS_IN_URL));
        }
        let prefix = || url.path().trim_matches('/').to_string();
        let bucket = |what: &str| match url.host_str() {
            Some(h) if !h.is_empty() => Ok(h.to_string()),
            _ => Err(fail(&format!(
                "no {what} name: write {}://{what}/prefix",
                url.scheme()
            ))),
        };
        match url.scheme() {
            "file" => {
                if url
                    .host_str()
                    .is_some_and(|h| !h.is_empty() && h != "localhost")
                {
                    return Err(fail(
                        "a file URL names a local absolute path: file:///dir (three slashes)",
                    ));
                }
                let root = url
                    .to_file_path()
                    .map_err(|_| fail("not an absolute local path"))?;
                if root == std::path::Path::new("/") {
                    return Err(fail("refusing to use / as a store"));
                }
                Ok(StoreLocation::File { root })
            }
            "memory" => Ok(StoreLocation::Memory {
                prefix: format!("{}{}", url.host_str().unwrap_or(""), url.path())
                    .trim_matches('/')
                    .to_string(),
            }),
            "s3" => Ok(StoreLocation::S3 {
                bucket: bucket("bucket")?,
                prefix: prefix(),
            }),
            "gs" => Ok(StoreLocation::Gcs {
                bucket: bucket("bucket")?,
                prefix: prefix(),
            }),
            "az" => Ok(StoreLocation::Azure {
                container: bucket("container")?,
                prefix: prefix(),
            }),
            other => Err(fail(&format!(
                "unknown scheme {other:?}; one of file, s3, gs, az, memory"
            ))),
        }
    }

    /// The prefix inside the bucket (empty for the bucket's root).
    pub fn prefix(&self) -> &str {
        match self {
            StoreLocation::File { .. } => "",
            StoreLocation::Memory { prefix }
            | StoreLocation::S3 { prefix, .. }
            | StoreLocation::Gcs { prefix, .. }
            | StoreLocation::Azure { prefix, .. } => prefix,
        }
    }
}

impl fmt::Display for StoreLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let join = |scheme: &str, b: &str, p: &str| {
            if p.is_empty() {
                format!("{scheme}://{b}")
            } else {
                format!("{scheme}://{b}/{p}")
            }
        };
        match self {
            StoreLocation::File { root } => write!(f, "file://{}", root.display()),
            StoreLocation::Memory { prefix } => write!(f, "memory://{prefix}"),
            StoreLocation::S3 { bucket, prefix } => f.write_str(&join("s3", bucket, prefix)),
            StoreLocation::Gcs { bucket, prefix } => f.write_str(&join("gs", bucket, prefix)),
            StoreLocation::Azure { container, prefix } => {
                f.write_str(&join("az", container, prefix))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_scheme() {
        let s = |bucket: &str, prefix: &str| StoreLocation::S3 {
            bucket: bucket.into(),
            prefix: prefix.into(),
        };
        for (url, want) in [
            (
                "file:///var/backups/etcd",
                StoreLocation::File {
                    root: "/var/backups/etcd".into(),
                },
            ),
            ("s3://bkt/a/b/", s("bkt", "a/b")),
            ("s3://bkt", s("bkt", "")),
            (
                "gs://b/p",
                StoreLocation::Gcs {
                    bucket: "b".into(),
                    prefix: "p".into(),
                },
            ),
            (
                "az://c/p",
                StoreLocation::Azure {
                    container: "c".into(),
                    prefix: "p".into(),
                },
            ),
            ("memory://x", StoreLocation::Memory { prefix: "x".into() }),
        ] {
            assert_eq!(StoreLocation::parse(url).unwrap(), want, "{url}");
        }
    }

    #[test]
    fn display_round_trips() {
        for u in [
            "file:///var/backups/etcd",
            "s3://bkt/a/b",
            "s3://bkt",
            "gs://b/p",
            "az://c/p",
            "memory://x",
        ] {
            assert_eq!(StoreLocation::parse(u).unwrap().to_string(), u);
        }
    }

    #[test]
    fn rejects_bad_urls_with_a_reason() {
        for (u, why) in [
            ("ftp://x/y", "unknown scheme"),
            ("s3:///prefix", "no bucket"),
            ("file://host/dir", "three slashes"),
            ("file:///", "refusing"),
            ("not a url", "not a URL"),
        ] {
            let e = StoreLocation::parse(u).unwrap_err().to_string();
            assert!(e.contains(why), "{u}: {e}");
        }
    }

    /// A user name or password in a store URL is refused, and the refusal does not repeat it.
    #[test]
    fn credentials_in_a_store_url_are_refused_unprinted() {
        for url in [
            "s3://AKIAEXAMPLE:s3cr3t@bkt/p",
            "s3://AKIAEXAMPLE@bkt/p",
            "gs://:s3cr3t@bkt",
            "az://AKIAEXAMPLE:s3cr3t@cont/p?x=@",
        ] {
            let e = StoreLocation::parse(url).unwrap_err().to_string();
            assert!(e.contains("user name or password"), "{e}");
            assert!(e.contains("<redacted>@"), "{e}");
            assert!(!e.contains("s3cr3t") && !e.contains("AKIAEXAMPLE"), "{e}");
        }
        // Not a store URL at all: still never repeated.
        for url in [
            "s4://AKIAEXAMPLE:s3cr3t@bkt",
            "file://AKIAEXAMPLE:s3cr3t@localhost/srv",
        ] {
            let e = StoreLocation::parse(url).unwrap_err().to_string();
            assert!(e.contains("<redacted>@") && !e.contains("s3cr3t"), "{e}");
        }
        for (text, want) in [
            (
                "http://u:p@host:9000/x@y",
                "http://<redacted>@host:9000/x@y",
            ),
            ("http://host:9000/a@b", "http://host:9000/a@b"),
            ("https://u:p@h@host", "https://<redacted>@host"),
            ("not a url", "not a url"),
        ] {
            assert_eq!(redact_url(text), want);
        }
    }
}
