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
            url: text.to_string(),
            reason: reason.to_string(),
        };
        let url = url::Url::parse(text.trim()).map_err(|e| {
            fail(&format!(
                "not a URL ({e}); write e.g. \"file:///var/backups/etcd\" or \"s3://bucket/prefix\""
            ))
        })?;
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
}
