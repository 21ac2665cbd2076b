//! Store credentials read from files and re-read when a file changes (secret rotation without a
//! restart). A file is re-read only when its modification time or length changed, so signing a
//! request costs one `stat` per file.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use async_trait::async_trait;
use object_store::CredentialProvider;
use object_store::aws::AwsCredential;
use object_store::azure::{AzureAccessKey, AzureCredential};

use crate::config::Secret;

/// What identifies one version of a file: its modification time and length (`None` while it
/// cannot be read).
pub(super) type Stamp = Option<(SystemTime, u64)>;

/// The current [`Stamp`] of `path`.
pub(super) fn file_stamp(path: &Path) -> Stamp {
    std::fs::metadata(path)
        .ok()
        .and_then(|m| Some((m.modified().ok()?, m.len())))
}

fn stamp(secret: &Secret) -> Stamp {
    match secret {
        Secret::Value(_) => None,
        Secret::File(p) => file_stamp(p),
    }
}

fn read(secret: &Secret, what: &'static str) -> object_store::Result<String> {
    secret.read().map_err(|e| object_store::Error::Generic {
        store: what,
        source: Box::new(e),
    })
}

/// A credential built from secrets, cached until one of their files changes.
#[derive(Debug)]
struct Cached<T> {
    secrets: Vec<Secret>,
    cache: Mutex<Option<(Vec<Stamp>, Arc<T>)>>,
}

impl<T> Cached<T> {
    fn new(secrets: Vec<Secret>) -> Self {
        Self {
            secrets,
            cache: Mutex::new(None),
        }
    }

    fn get(
        &self,
        make: impl FnOnce(&[Secret]) -> object_store::Result<T>,
    ) -> object_store::Result<Arc<T>> {
        let stamps: Vec<Stamp> = self.secrets.iter().map(stamp).collect();
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((seen, cred)) = cache.as_ref()
            && *seen == stamps
        {
            return Ok(cred.clone());
        }
        let cred = Arc::new(make(&self.secrets)?);
        *cache = Some((stamps, cred.clone()));
        Ok(cred)
    }
}

/// S3 access key id and secret, either or both from files.
#[derive(Debug)]
pub struct AwsFromFiles(Cached<AwsCredential>);

impl AwsFromFiles {
    /// Credentials from an access key id and a secret access key.
    pub fn new(key_id: Secret, secret_key: Secret) -> Self {
        Self(Cached::new(vec![key_id, secret_key]))
    }
}

#[async_trait]
impl CredentialProvider for AwsFromFiles {
    type Credential = AwsCredential;

    async fn get_credential(&self) -> object_store::Result<Arc<AwsCredential>> {
        self.0.get(|s| {
            Ok(AwsCredential {
                key_id: read(&s[0], "S3")?,
                secret_key: read(&s[1], "S3")?,
                token: None,
            })
        })
    }
}

/// An Azure shared account key from a file.
#[derive(Debug)]
pub struct AzureFromFile(Cached<AzureCredential>);

impl AzureFromFile {
    /// Credentials from an account key.
    pub fn new(key: Secret) -> Self {
        Self(Cached::new(vec![key]))
    }
}

#[async_trait]
impl CredentialProvider for AzureFromFile {
    type Credential = AzureCredential;

    async fn get_credential(&self) -> object_store::Result<Arc<AzureCredential>> {
        self.0.get(|s| {
            Ok(AzureCredential::AccessKey(AzureAccessKey::try_new(&read(
                &s[0],
                "MicrosoftAzure",
            )?)?))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn rereads_a_changed_file() {
        let dir = tempfile::tempdir().unwrap();
        let id = dir.path().join("id");
        let key = dir.path().join("key");
        std::fs::write(&id, "first-id\n").unwrap();
        std::fs::write(&key, "k1").unwrap();
        let p = AwsFromFiles::new(Secret::File(id.clone()), Secret::File(key.clone()));
        let c = p.get_credential().await.unwrap();
        assert_eq!(
            (c.key_id.as_str(), c.secret_key.as_str()),
            ("first-id", "k1")
        );
        // A longer value changes the length even when the mtime granularity hides the write.
        std::fs::write(&key, "k2-rotated").unwrap();
        let c = p.get_credential().await.unwrap();
        assert_eq!(c.secret_key, "k2-rotated");
        std::fs::remove_file(&id).unwrap();
        assert!(p.get_credential().await.is_err());
    }

    #[tokio::test]
    async fn azure_key_from_file() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("key");
        std::fs::write(&key, "a2V5\n").unwrap();
        let p = AzureFromFile::new(Secret::File(key.clone()));
        assert!(p.get_credential().await.is_ok());
        std::fs::write(&key, "not base64 !!").unwrap();
        assert!(p.get_credential().await.is_err());
    }
}
