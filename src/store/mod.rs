//! Object stores from URLs, the etcd-backup-restore bucket layout, and retention.
//!
//! [`build`] turns a [`StoreConfig`] into an `object_store` backend; [`SnapshotStore`] reads and
//! writes snapshots in the layout of [`layout`] on top of it.

pub mod compression;
mod credentials;
pub mod encryption;
pub mod gc;
mod gzip_members;
pub mod layout;
mod local;
pub mod object_lock;
pub mod paged;
pub mod private;
pub mod reload;
pub mod single_put;

use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::MicrosoftAzureBuilder;
use object_store::chunked::ChunkedStore;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload, WriteMultipart};

use crate::config::{EncryptionConfig, EnvSource, Secret, ServerSideEncryption, StoreConfig};
use encryption::EncryptionError;

/// Bounds on what a stored snapshot may decompress to: configuration's (`restore.max_…`).
pub use crate::config::ReadLimits;
/// Where a store is: its type and parser live in `config` (a store URL is configuration).
pub use crate::config::StoreLocation;
pub use compression::{ByteStream, Codec};
pub use layout::{Chain, Kind, Snapshot};
pub use object_lock::{Lock, S3ObjectLock};
pub use single_put::SinglePut;

/// Part size of multipart uploads: S3's minimum for every part but the last, so memory stays
/// small; with at most 10000 parts an object can reach 48 GiB, far above etcd's 8 GiB limit.
const PART_SIZE: usize = 5 << 20;
/// Part size on the local filesystem and in memory, which have no minimum: smaller parts keep
/// a snapshot's memory down (the parts in flight are most of it).
const LOCAL_PART_SIZE: usize = 1 << 20;
/// Parts uploading at once; with [`PART_SIZE`] this bounds an upload's memory.
const PARTS_IN_FLIGHT: usize = 2;

/// Azurite's well-known development account and key (public, documented by Microsoft).
const EMULATOR_ACCOUNT: &str = "devstoreaccount1";
const EMULATOR_ACCOUNT_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// Store errors.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The backend could not be built from the configuration. The message includes the cause,
    /// so it is not also the error's source (which would print it twice).
    #[error("cannot set up store {url}: {cause}")]
    Build {
        /// The store URL.
        url: String,
        /// What failed (boxed: a store error is passed around far more often than built).
        cause: Box<BuildError>,
    },
    /// A backend operation failed.
    #[error(transparent)]
    Backend(#[from] object_store::Error),
    /// Reading the payload failed (the upload was aborted).
    #[error("snapshot payload failed: {0}")]
    Payload(#[source] std::io::Error),
    /// The snapshot cannot be encrypted or decrypted with the configured keys.
    #[error(transparent)]
    Encryption(Box<encryption::EncryptionError>),
}

impl From<EncryptionError> for StoreError {
    fn from(e: EncryptionError) -> StoreError {
        StoreError::Encryption(Box::new(e))
    }
}

impl StoreError {
    /// The store of `config` could not be set up.
    fn build(config: &StoreConfig, cause: BuildError) -> StoreError {
        StoreError::Build {
            url: config.location.to_string(),
            cause: Box::new(cause),
        }
    }
}

/// A snapshot that decompresses to more than its bound ([`ReadLimits`]): a damaged or planted
/// object (a decompression bomb), never read further. It reaches callers inside an
/// [`std::io::Error`] of kind `InvalidData`, as a payload failing its hash does, so a restore
/// treats it as it treats a corrupt snapshot; [`Oversized::of`] finds it there.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "it decompresses to more than {limit} bytes ({why}); if the snapshot is genuine, raise {key}"
)]
pub struct Oversized {
    /// The snapshot's name.
    pub snapshot: String,
    /// The bound it exceeded, in bytes.
    pub limit: u64,
    /// How the bound was reached.
    pub why: String,
    /// The configuration key that sets the bound.
    pub key: &'static str,
}

impl Oversized {
    /// The [`Oversized`] an I/O error carries, if it is one.
    pub fn of(e: &std::io::Error) -> Option<&Oversized> {
        e.get_ref()
            .and_then(|inner| inner.downcast_ref::<Oversized>())
    }

    /// As the I/O error a decode stopped at its bound returns.
    pub fn into_io(self) -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::InvalidData, self)
    }
}

/// Why a store's backend could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The local store's directory could not be created.
    #[error("cannot create {}: {source}", path.display())]
    CreateDir {
        /// The directory.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Only one half of a static S3 key pair is configured.
    #[error("give both access_key_id and secret_access_key, or neither")]
    HalfKeyPair,
    /// `object_store` refused the configuration (a missing bucket, an unreadable service
    /// account file, …).
    #[error(transparent)]
    Backend(#[from] object_store::Error),
    /// The HTTP client for single `PUT`s could not be built.
    #[error("HTTP client: {0}")]
    Http(#[from] reqwest::Error),
    /// The server-side encryption configuration cannot make request headers.
    #[error("server-side encryption: {0}")]
    Encryption(String),
    /// The CA file (`ca_file`) cannot be read or holds no certificate.
    #[error("CA file {}: {message}", path.display())]
    Ca {
        path: std::path::PathBuf,
        message: String,
    },
}

/// Builds the backend for a store from its configuration and the process environment.
pub fn build(config: &StoreConfig) -> Result<Arc<dyn ObjectStore>, StoreError> {
    build_with_env(config, &crate::config::ProcessEnv, None)
}

/// Builds the backend for a store. Provider variables (`AWS_…`, `GOOGLE_…`, `AZURE_…`) come from
/// `env`; with `env_prefix` (e.g. `"SOURCE_"` for the copy job's source) the prefixed names win
/// over the plain ones. Explicit configuration wins over both.
pub fn build_with_env(
    config: &StoreConfig,
    env: &dyn EnvSource,
    env_prefix: Option<&str>,
) -> Result<Arc<dyn ObjectStore>, StoreError> {
    backend(config, &|family| provider_env(env, env_prefix, family))
        .map_err(|cause| StoreError::build(config, cause))
}

/// The size of a read from a `file://` store.
const LOCAL_READ_CHUNK: usize = 1 << 20;

/// The backend of [`build_with_env`]; `vars` gives one family's provider variables.
fn backend(
    config: &StoreConfig,
    vars: &dyn Fn(&str) -> Vec<(String, String)>,
) -> Result<Arc<dyn ObjectStore>, BuildError> {
    Ok(match &config.location {
        StoreLocation::File { root } => {
            let mut dirs = std::fs::DirBuilder::new();
            dirs.recursive(true);
            if config.private {
                // Created private; an existing root is made private at the first write.
                std::os::unix::fs::DirBuilderExt::mode(&mut dirs, private::DIR_MODE);
            }
            dirs.create(root).map_err(|source| BuildError::CreateDir {
                path: root.clone(),
                source,
            })?;
            let files = Arc::new(private::PrivateFiles::with_modes(root, config.private)?);
            // object_store streams a local file in 8 KiB reads, each on its own blocking task:
            // a restore of a large snapshot spent more time handing those over than inflating
            // them. Reads of 1 MiB keep the stream's memory small and the hand-overs few.
            Arc::new(ChunkedStore::new(files, LOCAL_READ_CHUNK))
        }
        StoreLocation::Memory { .. } => Arc::new(InMemory::new()),
        StoreLocation::S3 { bucket, .. } => {
            Arc::new(s3_builder(config, bucket, &vars("AWS_"))?.build()?)
        }
        StoreLocation::Gcs { bucket, .. } => {
            let b = gcs_builder(config, bucket, &vars("GOOGLE_"))?;
            // The builder reads the service account file once; rebuild when it changes.
            let file = b
                .get_config_value(&object_store::gcp::GoogleConfigKey::ServiceAccount)
                .map(std::path::PathBuf::from);
            match file {
                Some(file) => Arc::new(reload::Reloading::new(vec![file], move || {
                    Ok(Arc::new(b.clone().build()?) as _)
                })?),
                None => Arc::new(b.build()?),
            }
        }
        StoreLocation::Azure { container, .. } => {
            Arc::new(azure_builder(config, container, &vars("AZURE_"))?.build()?)
        }
    })
}

/// The HTTP client options of a cloud store: plain http when allowed, its CA (`ca_file`)
/// besides the system's roots.
fn client_options(config: &StoreConfig) -> Result<object_store::ClientOptions, BuildError> {
    let mut options = object_store::ClientOptions::new().with_allow_http(config.allow_http);
    if let Some(ca) = &config.ca_file {
        let ca_err = |message: String| BuildError::Ca {
            path: ca.clone(),
            message,
        };
        let pem = std::fs::read(ca).map_err(|e| ca_err(e.to_string()))?;
        for cert in
            object_store::Certificate::from_pem_bundle(&pem).map_err(|e| ca_err(e.to_string()))?
        {
            options = options.with_root_certificate(cert);
        }
    }
    Ok(options)
}

/// The GCS builder: environment first, explicit configuration over it. Without a service
/// account file (or `GOOGLE_APPLICATION_CREDENTIALS`), object_store asks the metadata server:
/// GKE's workload identity.
fn gcs_builder(
    config: &StoreConfig,
    bucket: &str,
    vars: &[(String, String)],
) -> Result<GoogleCloudStorageBuilder, BuildError> {
    let mut b = with_vars(
        GoogleCloudStorageBuilder::new().with_client_options(client_options(config)?),
        vars,
        |b, k, v| b.with_config(k, v),
    )
    .with_bucket_name(bucket);
    if let Some(ep) = &config.endpoint {
        b = b.with_config(
            object_store::gcp::GoogleConfigKey::BaseUrl,
            ep.trim_end_matches('/'),
        );
    }
    Ok(match &config.service_account_file {
        Some(sa) => b.with_service_account_path(sa.to_string_lossy()),
        None => b,
    })
}

/// The Azure builder: environment first, explicit configuration over it.
fn azure_builder(
    config: &StoreConfig,
    container: &str,
    vars: &[(String, String)],
) -> Result<MicrosoftAzureBuilder, BuildError> {
    let mut b = with_vars(
        MicrosoftAzureBuilder::new().with_client_options(client_options(config)?),
        vars,
        |b, k, v| b.with_config(k, v),
    )
    .with_container_name(container);
    if let Some(a) = &config.account_name {
        b = b.with_account(a);
    }
    match (config.use_emulator, &config.endpoint) {
        // object_store's emulator mode takes its URL only from AZURITE_BLOB_STORAGE_URL;
        // with an explicit endpoint, address the emulator's account path-style instead.
        (true, Some(ep)) => {
            let account = config.account_name.as_deref().unwrap_or(EMULATOR_ACCOUNT);
            b = b
                .with_account(account)
                .with_endpoint(format!("{}/{account}", ep.trim_end_matches('/')))
                .with_allow_http(true);
            if config.account_key.is_none() && config.azure_identity.is_none() {
                b = b.with_access_key(EMULATOR_ACCOUNT_KEY);
            }
        }
        (true, None) => b = b.with_use_emulator(true),
        (false, Some(ep)) => b = b.with_endpoint(ep.clone()),
        (false, None) => {}
    }
    if config.allow_http {
        b = b.with_allow_http(true);
    }
    match &config.account_key {
        Some(Secret::Value(k)) => b = b.with_access_key(k),
        Some(file @ Secret::File(_)) => {
            b = b.with_credentials(Arc::new(credentials::AzureFromFile::new(file.clone())));
        }
        None => {}
    }
    // object_store reads the token file again at every exchange.
    if let Some(id) = &config.azure_identity {
        b = b
            .with_client_id(&id.client_id)
            .with_tenant_id(&id.tenant_id)
            .with_federated_token_file(id.token_file.to_string_lossy());
        if let Some(host) = &id.authority_host {
            b = b.with_authority_host(host);
        }
    }
    Ok(b)
}

/// Streamed single `PUT`s for a store, where its backend supports them (S3; see
/// [`single_put`]). Same configuration and environment as [`build_with_env`].
pub fn single_put_with_env(
    config: &StoreConfig,
    env: &dyn EnvSource,
    env_prefix: Option<&str>,
) -> Result<Option<SinglePut>, StoreError> {
    let StoreLocation::S3 { bucket, .. } = &config.location else {
        return Ok(None);
    };
    let vars = provider_env(env, env_prefix, "AWS_");
    s3_builder(config, bucket, &vars)
        .and_then(|b| SinglePut::for_s3(&b, config.ca_file.as_deref()))
        .map_err(|cause| StoreError::build(config, cause))
}

/// The page-by-page listing of a cloud store ([`paged`]), for a listing that fails on a key
/// that is no object key; `None` for `file://` (listed directly) and `memory://`. Same
/// configuration and environment as [`build_with_env`].
pub fn pager_with_env(
    config: &StoreConfig,
    env: &dyn EnvSource,
    env_prefix: Option<&str>,
) -> Result<Option<paged::Pager>, StoreError> {
    let built = |e: BuildError| StoreError::build(config, e);
    Ok(Some(match &config.location {
        StoreLocation::File { .. } | StoreLocation::Memory { .. } => return Ok(None),
        StoreLocation::S3 { bucket, .. } => {
            let b = s3_builder(config, bucket, &provider_env(env, env_prefix, "AWS_"))
                .map_err(built)?;
            paged::Pager::new(move || Ok(Arc::new(b.clone().build()?) as _), false)
        }
        StoreLocation::Gcs { bucket, .. } => {
            let b = gcs_builder(config, bucket, &provider_env(env, env_prefix, "GOOGLE_"))
                .map_err(built)?;
            paged::Pager::new(move || Ok(Arc::new(b.clone().build()?) as _), false)
        }
        StoreLocation::Azure { container, .. } => {
            let b = azure_builder(config, container, &provider_env(env, env_prefix, "AZURE_"))
                .map_err(built)?;
            // Azure's list offset (`startFrom`) includes the key it names.
            paged::Pager::new(move || Ok(Arc::new(b.clone().build()?) as _), true)
        }
    }))
}

/// S3 Object Lock for a store (S3 only; see [`object_lock`]): the configured retention of new
/// snapshots, and reading locks before retention deletes. Same configuration and environment
/// as [`build_with_env`].
pub fn object_lock_with_env(
    config: &StoreConfig,
    env: &dyn EnvSource,
    env_prefix: Option<&str>,
) -> Result<Option<S3ObjectLock>, StoreError> {
    let StoreLocation::S3 { bucket, .. } = &config.location else {
        return Ok(None);
    };
    let vars = provider_env(env, env_prefix, "AWS_");
    s3_builder(config, bucket, &vars)
        .and_then(|b| S3ObjectLock::for_s3(&b, config.object_lock, config.ca_file.as_deref()))
        .map(Some)
        .map_err(|cause| StoreError::build(config, cause))
}

/// The S3 builder: environment first, explicit configuration over it.
fn s3_builder(
    config: &StoreConfig,
    bucket: &str,
    vars: &[(String, String)],
) -> Result<AmazonS3Builder, BuildError> {
    let env_sets_style = vars
        .iter()
        .any(|(key, _)| key == "AWS_VIRTUAL_HOSTED_STYLE_REQUEST");
    // Client options first: the variables and keys below set some of them.
    let mut b = with_vars(
        AmazonS3Builder::new().with_client_options(client_options(config)?),
        vars,
        |b, k, v| b.with_config(k, v),
    )
    .with_bucket_name(bucket);
    if let Some(ep) = &config.endpoint {
        b = b.with_endpoint(ep);
    }
    if let Some(r) = &config.region {
        b = b.with_region(r);
    }
    // path_style defaults to true in the embedded config, so only a non-default value is
    // "explicit" enough to override the environment.
    if !config.path_style || !env_sets_style {
        b = b.with_virtual_hosted_style_request(!config.path_style);
    }
    if config.allow_http {
        b = b.with_allow_http(true);
    }
    match (&config.access_key_id, &config.secret_access_key) {
        (Some(Secret::Value(id)), Some(Secret::Value(key))) => {
            b = b.with_access_key_id(id).with_secret_access_key(key);
        }
        (Some(id), Some(key)) => {
            b = b.with_credentials(Arc::new(credentials::AwsFromFiles::new(
                id.clone(),
                key.clone(),
            )));
        }
        (None, None) => {}
        _ => return Err(BuildError::HalfKeyPair),
    }
    // object_store reads the token file again on every renewal of the temporary credentials.
    if let Some(w) = &config.web_identity {
        b = b
            .with_config(AmazonS3ConfigKey::RoleArn, &w.role_arn)
            .with_config(
                AmazonS3ConfigKey::WebIdentityTokenFile,
                w.token_file.to_string_lossy(),
            );
        if let Some(sts) = &w.sts_endpoint {
            b = b.with_config(AmazonS3ConfigKey::StsEndpoint, sts);
        }
    }
    // Every request that writes an object (a PUT, a multipart upload, a copy) carries the
    // encryption; with SSE-C every read too. Single PUTs carry it as well ([`SinglePut`]).
    if let Some(sse) = &config.sse {
        // object_store does not export its encryption key enum; its names parse.
        let key = |name: &str| {
            name.parse::<AmazonS3ConfigKey>()
                .expect("object_store's SSE key names")
        };
        b = b.with_config(key("aws_server_side_encryption"), sse.algorithm());
        match sse {
            ServerSideEncryption::Kms {
                key_id: Some(id), ..
            } => b = b.with_config(key("aws_sse_kms_key_id"), id),
            ServerSideEncryption::Customer { key_base64 } => {
                b = b.with_ssec_encryption(key_base64);
            }
            _ => {}
        }
    }
    Ok(b)
}

/// `builder` given every variable of `vars` it has a key for (`AWS_REGION` is `aws_region`);
/// the others are ignored.
fn with_vars<B, K: std::str::FromStr>(
    builder: B,
    vars: &[(String, String)],
    set: impl Fn(B, K, &str) -> B,
) -> B {
    vars.iter().fold(builder, |b, (key, value)| {
        match key.to_ascii_lowercase().parse() {
            Ok(k) => set(b, k, value),
            Err(_) => b,
        }
    })
}

/// Provider variables of one family (`AWS_`), the `env_prefix`ed names overriding plain ones.
fn provider_env(
    env: &dyn EnvSource,
    env_prefix: Option<&str>,
    family: &str,
) -> Vec<(String, String)> {
    let vars = env.vars();
    let mut out: std::collections::BTreeMap<String, String> = vars
        .iter()
        .filter(|(k, _)| k.starts_with(family))
        .cloned()
        .collect();
    if let Some(p) = env_prefix {
        for (k, v) in &vars {
            if let Some(plain) = k.strip_prefix(p).filter(|k| k.starts_with(family)) {
                out.insert(plain.to_string(), v.clone());
            }
        }
    }
    out.into_iter().collect()
}

/// What [`SnapshotStore::listing`] found under `<prefix>/v2/`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listing {
    /// The snapshots and their stored sizes, oldest first.
    pub snapshots: Vec<(Snapshot, u64)>,
    /// The objects whose names are not snapshot names, by key.
    pub unrecognised: Vec<Unrecognised>,
}

impl Listing {
    /// The snapshots without their sizes.
    pub fn snapshots(&self) -> Vec<Snapshot> {
        self.snapshots.iter().map(|(s, _)| s.clone()).collect()
    }

    /// The unrecognised objects' names (under `<prefix>/v2/`), for a message.
    pub fn unrecognised_names(&self) -> Vec<&str> {
        self.unrecognised.iter().map(|u| u.name.as_str()).collect()
    }
}

/// An object under `<prefix>/v2/` whose name is not a snapshot name: nothing restores, copies,
/// retains or deletes it. `ls --json` shows it with `kind` `"Unrecognised"`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase", tag = "kind", rename = "Unrecognised")]
pub struct Unrecognised {
    /// The object's key.
    pub key: String,
    /// Its name under `<prefix>/v2/` (`Full-xyz`, or `<name>/<chunk>` for a chunk object).
    pub name: String,
    /// Its stored size in bytes.
    pub size: u64,
    /// Why the name is not a snapshot name.
    pub reason: String,
}

/// Snapshots in a store, in the etcd-backup-restore `v2` layout.
#[derive(Clone, Debug)]
pub struct SnapshotStore {
    store: Arc<dyn ObjectStore>,
    /// The store prefix (without `v2`).
    prefix: String,
    /// Multipart part size for [`SnapshotStore::put_stream`].
    part_size: usize,
    /// Single streamed `PUT`s for payloads of known length, where the backend has them.
    single_put: Option<SinglePut>,
    /// Keys: recipients encrypt new snapshots, identities read encrypted ones.
    encryption: Arc<EncryptionConfig>,
    /// How hard new gzip and zlib payloads are compressed.
    compression_level: compression::Level,
    /// S3 Object Lock: retention written on new snapshots, locks read before deletes.
    object_lock: Option<S3ObjectLock>,
    /// Keys of the locked snapshots retention has logged: each is logged once per process.
    locks_logged: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    /// How far a snapshot read from here may decompress.
    read_limits: ReadLimits,
    /// A `file://` store's directory: listed directly ([`local`]), so a file whose name is no
    /// object key is reported instead of ending the listing.
    local_root: Option<std::path::PathBuf>,
    /// A cloud store's listing page by page, taken when the backend's listing fails on a key
    /// that is no object key ([`paged`]).
    pager: Option<paged::Pager>,
}

/// A multipart upload that is aborted when dropped unfinished: a snapshot that timed out or
/// was cancelled leaves no parts behind, and no completion can follow once the abort landed.
struct AbortOnDrop {
    writer: Option<WriteMultipart>,
    path: Path,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        let Some(writer) = self.writer.take() else {
            return;
        };
        let path = std::mem::replace(&mut self.path, Path::from(""));
        // Drop cannot wait: the abort runs on the runtime (there is always one where uploads
        // run), and its outcome is logged.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                match writer.abort().await {
                    Ok(()) => tracing::info!(key = %path, "abandoned upload aborted"),
                    Err(e) => {
                        tracing::warn!(key = %path, error = %e, "aborting an abandoned upload failed")
                    }
                }
            });
        }
    }
}

impl SnapshotStore {
    /// Snapshots under `prefix` (the URL's path) of a backend.
    pub fn new(store: Arc<dyn ObjectStore>, prefix: &str) -> Self {
        Self {
            store,
            prefix: prefix.trim_matches('/').to_string(),
            part_size: PART_SIZE,
            single_put: None,
            encryption: Arc::new(EncryptionConfig::default()),
            compression_level: compression::Level::FAST,
            object_lock: None,
            locks_logged: Arc::default(),
            read_limits: ReadLimits::default(),
            local_root: None,
            pager: None,
        }
    }

    /// Snapshots at `location` of a backend built for it: its prefix, and parts sized for it.
    pub fn at(store: Arc<dyn ObjectStore>, location: &StoreLocation) -> Self {
        let part_size = match location {
            StoreLocation::File { .. } | StoreLocation::Memory { .. } => LOCAL_PART_SIZE,
            StoreLocation::S3 { .. } | StoreLocation::Gcs { .. } | StoreLocation::Azure { .. } => {
                PART_SIZE
            }
        };
        let local_root = match location {
            StoreLocation::File { root } => Some(root.clone()),
            _ => None,
        };
        Self {
            part_size,
            local_root,
            ..Self::new(store, location.prefix())
        }
    }

    /// Bounds what snapshots read from here may decompress to (`[restore]`'s `max_delta_size`
    /// and `max_inflation_ratio`); without it, [`ReadLimits::default`].
    pub fn with_read_limits(self, read_limits: ReadLimits) -> Self {
        Self {
            read_limits,
            ..self
        }
    }

    /// The bounds snapshots read from here are held to.
    pub fn read_limits(&self) -> ReadLimits {
        self.read_limits
    }

    /// Builds the backend from configuration and the process environment.
    pub fn from_config(config: &StoreConfig) -> Result<Self, StoreError> {
        let env = crate::config::ProcessEnv;
        Ok(Self::at(build(config)?, &config.location)
            .with_single_put(single_put_with_env(config, &env, None)?)
            .with_object_lock(object_lock_with_env(config, &env, None)?)
            .with_pager(pager_with_env(config, &env, None)?))
    }

    /// Lists through `pager` when the backend's own listing fails on a key that is no object
    /// key ([`pager_with_env`]).
    pub fn with_pager(self, pager: Option<paged::Pager>) -> Self {
        Self { pager, ..self }
    }

    /// Retains new snapshots and reads locks through `object_lock` (S3 Object Lock).
    pub fn with_object_lock(self, object_lock: Option<S3ObjectLock>) -> Self {
        Self {
            object_lock,
            ..self
        }
    }

    /// Puts the configured Object Lock retention on a snapshot just written (nothing when none
    /// is configured). Every write of [`SnapshotStore`] does this; a copy made by the backend
    /// itself (the copy job's server-side copy) calls it.
    pub async fn retain(&self, snapshot: &Snapshot) -> Result<(), StoreError> {
        match &self.object_lock {
            Some(lock) if lock.retains() => {
                lock.retain(&self.path_of(snapshot), chrono::Utc::now())
                    .await
            }
            _ => Ok(()),
        }
    }

    /// Whether the store keeps `snapshot` for now (S3 Object Lock retention or legal hold), as
    /// a `HEAD` says; `None` on stores where it cannot be read ahead (GCS and Azure refuse the
    /// delete instead: [`object_lock::is_lock_refusal`]).
    pub async fn lock(&self, snapshot: &Snapshot) -> Result<Option<Lock>, StoreError> {
        match &self.object_lock {
            Some(lock) => {
                lock.lock_of(&self.path_of(snapshot), chrono::Utc::now())
                    .await
            }
            None => Ok(None),
        }
    }

    /// Whether `snapshot` is found locked for the first time in this process (so it is logged
    /// once, not at every retention pass); `false` again once [`SnapshotStore::unlocked`].
    pub fn first_seen_locked(&self, snapshot: &Snapshot) -> bool {
        self.locks_logged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(self.path_of(snapshot).to_string())
    }

    /// Forgets that `snapshot` was locked (it was deleted).
    pub fn unlocked(&self, snapshot: &Snapshot) {
        self.locks_logged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(self.path_of(snapshot).as_ref());
    }

    /// Uploads payloads of known length through `single_put` where it takes them.
    pub fn with_single_put(self, single_put: Option<SinglePut>) -> Self {
        Self { single_put, ..self }
    }

    /// Encrypts new snapshots to `encryption`'s recipients (when it has any) and reads
    /// encrypted ones with its identities.
    pub fn with_encryption(self, encryption: EncryptionConfig) -> Self {
        Self {
            encryption: Arc::new(encryption),
            ..self
        }
    }

    /// Compresses new gzip and zlib payloads at `level` (reading needs no level).
    pub fn with_compression_level(self, level: compression::Level) -> Self {
        Self {
            compression_level: level,
            ..self
        }
    }

    /// The level new gzip and zlib payloads are compressed at.
    pub fn compression_level(&self) -> compression::Level {
        self.compression_level
    }

    /// Whether new snapshots are encrypted.
    pub fn encrypts(&self) -> bool {
        self.encryption.encrypts()
    }

    /// The store prefix (without `v2`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// Metadata for a new snapshot in this store.
    pub fn new_snapshot(
        &self,
        kind: Kind,
        start_revision: i64,
        last_revision: i64,
        compression: Codec,
        is_final: bool,
    ) -> Snapshot {
        Snapshot::new(
            &self.prefix,
            kind,
            start_revision,
            last_revision,
            chrono::Utc::now(),
            compression,
            is_final,
        )
        .with_encryption(self.encrypts())
    }

    /// The payload as it is stored: encrypted to the recipients as they are now when `snapshot`
    /// is an encrypted one. A key file that cannot be read fails the snapshot; it is never
    /// stored in clear instead.
    pub fn seal(&self, snapshot: &Snapshot, payload: ByteStream) -> Result<ByteStream, StoreError> {
        if !snapshot.encrypted {
            return Ok(payload);
        }
        Ok(encryption::encrypt(payload, self.recipients(snapshot)?))
    }

    fn recipients(&self, snapshot: &Snapshot) -> Result<Vec<age::x25519::Recipient>, StoreError> {
        self.keys(snapshot, EncryptionConfig::load_recipients, |snapshot| {
            EncryptionError::NoRecipient { snapshot }
        })
    }

    /// The identities that read `snapshot`, as the key files are now; an error names the
    /// snapshot when there are none.
    fn identities(&self, snapshot: &Snapshot) -> Result<Vec<age::x25519::Identity>, StoreError> {
        self.keys(snapshot, EncryptionConfig::load_identities, |snapshot| {
            EncryptionError::NoIdentity { snapshot }
        })
    }

    /// Keys loaded by `load` for `snapshot`: a key file that cannot be read, or no key at all
    /// (`none`), is an error naming the snapshot.
    fn keys<K>(
        &self,
        snapshot: &Snapshot,
        load: impl FnOnce(&EncryptionConfig) -> Result<Vec<K>, crate::config::KeyError>,
        none: impl FnOnce(String) -> EncryptionError,
    ) -> Result<Vec<K>, StoreError> {
        let keys = load(&self.encryption).map_err(|source| EncryptionError::Key {
            snapshot: snapshot.snap_name.clone(),
            source,
        })?;
        if keys.is_empty() {
            return Err(none(snapshot.snap_name.clone()).into());
        }
        Ok(keys)
    }

    /// Checks that every encrypted snapshot among `snapshots` can be decrypted with the
    /// configured identities, reading only each one's header: what a restore checks before it
    /// writes anything. Plain snapshots pass without a read.
    pub async fn check_decryptable(&self, snapshots: &[&Snapshot]) -> Result<(), StoreError> {
        let encrypted: Vec<&Snapshot> = snapshots.iter().copied().filter(|s| s.encrypted).collect();
        let Some(first) = encrypted.first() else {
            return Ok(());
        };
        let identities = Arc::new(self.identities(first)?);
        let checks = encrypted.into_iter().map(|snapshot| {
            let identities = identities.clone();
            async move {
                let head = self.head(snapshot).await?;
                encryption::check_header(&head, &identities).map_err(|e| match e {
                    encryption::HeaderError::Read(e) => StoreError::Payload(e),
                    reason => StoreError::from(EncryptionError::Undecryptable {
                        snapshot: snapshot.snap_name.clone(),
                        files: self.identity_files(),
                        reason: reason.to_string(),
                    }),
                })
            }
        });
        futures::stream::iter(checks)
            .buffer_unordered(8)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect()
    }

    /// The first [`encryption::HEADER_PROBE`] bytes of `snapshot` (all of it when shorter): room
    /// for any age header accepted and its nonce. Read from the start of a plain GET rather than
    /// asked for as a range, which a store refuses for an object shorter than the range's start
    /// (an empty one).
    async fn head(&self, snapshot: &Snapshot) -> Result<Vec<u8>, StoreError> {
        let mut stream = self.store.get(&self.path_of(snapshot)).await?.into_stream();
        let mut head = Vec::new();
        while head.len() < encryption::HEADER_PROBE {
            match stream.next().await {
                Some(chunk) => head.extend_from_slice(&chunk?),
                None => break,
            }
        }
        head.truncate(encryption::HEADER_PROBE);
        Ok(head)
    }

    fn identity_files(&self) -> String {
        let files: Vec<String> = self
            .encryption
            .identities
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        files.join(", ")
    }

    /// Where a snapshot of this name lives in this store: `<prefix>/v2/<name>`. The store, not
    /// the snapshot's recorded prefix, decides, so a snapshot listed in one store can be
    /// written to another (the copy job).
    pub fn path_of(&self, snapshot: &Snapshot) -> Path {
        Path::from(format!(
            "{}{}",
            layout::version_prefix(&self.prefix),
            snapshot.snap_name
        ))
    }

    /// The same snapshot as it is named in this store (its prefix replaced).
    pub fn adopt(&self, snapshot: &Snapshot) -> Snapshot {
        Snapshot {
            prefix: layout::version_prefix(&self.prefix),
            ..snapshot.clone()
        }
    }

    /// Every snapshot, sorted as the reference sorts (last revision, then creation time).
    /// Objects that are not snapshots (chunks, other tools' files) are logged and skipped.
    pub async fn list(&self) -> Result<Vec<Snapshot>, StoreError> {
        Ok(self
            .list_sized()
            .await?
            .into_iter()
            .map(|(s, _)| s)
            .collect())
    }

    /// Every snapshot with its stored size, sorted as [`SnapshotStore::list`] sorts. Objects
    /// under `<prefix>/v2/` that are not snapshots are logged at debug level only: retention
    /// lists every minute, and a README or another tool's chunk objects would otherwise repeat
    /// in the log forever. [`SnapshotStore::listing`] reports them.
    pub async fn list_sized(&self) -> Result<Vec<(Snapshot, u64)>, StoreError> {
        let listing = self.listing().await?;
        for u in &listing.unrecognised {
            tracing::debug!(key = %u.key, reason = %u.reason, "not a snapshot, ignored");
        }
        Ok(listing.snapshots)
    }

    /// Every object under `<prefix>/v2/`: the snapshots with their sizes, sorted as
    /// [`SnapshotStore::list`] sorts, and the objects whose names are not snapshot names, by
    /// key. What an operator's command shows (`ls`, `verify`, `restore`, `copy`): a name that
    /// does not parse may be a snapshot damaged by hand or by another tool, and nothing
    /// restores, copies or retains it.
    pub async fn listing(&self) -> Result<Listing, StoreError> {
        let dir = layout::version_prefix(&self.prefix);
        let mut out = Listing::default();
        for entry in self.objects_under(&dir).await? {
            let (key, size) = match entry {
                local::Entry::Object { key, size } => (key, size),
                local::Entry::Unnamed { key, size, reason } => {
                    let name = key.strip_prefix(dir.as_str()).unwrap_or(&key).to_string();
                    out.unrecognised.push(Unrecognised {
                        key,
                        name,
                        size,
                        reason,
                    });
                    continue;
                }
            };
            let Some(name) = key.strip_prefix(dir.as_str()) else {
                tracing::debug!(key, "object outside the layout directory, ignored");
                continue;
            };
            match Snapshot::parse_name(&self.prefix, name) {
                Ok(s) => out.snapshots.push((s, size)),
                Err(e) => out.unrecognised.push(Unrecognised {
                    key: key.to_string(),
                    name: name.to_string(),
                    size,
                    reason: e.reason,
                }),
            }
        }
        out.snapshots.sort_by(|a, b| layout::compare(&a.0, &b.0));
        out.unrecognised.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    /// Every object under `dir` with its size: a `file://` store's directory read directly
    /// ([`local`]), any other through the backend.
    async fn objects_under(&self, dir: &str) -> Result<Vec<local::Entry>, StoreError> {
        if let Some(root) = self.local_root.clone() {
            let dir = dir.to_string();
            let listed = tokio::task::spawn_blocking(move || local::list(&root, &dir))
                .await
                .map_err(|join| StoreError::Payload(std::io::Error::other(join)))?;
            return listed.map_err(|source| {
                StoreError::Backend(object_store::Error::Generic {
                    store: "LocalFileSystem",
                    source: Box::new(source),
                })
            });
        }
        let listing = Path::from(dir.trim_end_matches('/'));
        let mut objects = self.store.list(Some(&listing));
        let mut out = Vec::new();
        while let Some(meta) = objects.next().await {
            match meta {
                Ok(meta) => out.push(local::Entry::Object {
                    key: meta.location.to_string(),
                    size: meta.size,
                }),
                // One key that is no object key failed the whole listing: taken again page
                // by page, that key an entry of its own.
                Err(object_store::Error::InvalidPath { source }) => {
                    let Some(pager) = &self.pager else {
                        return Err(object_store::Error::InvalidPath { source }.into());
                    };
                    tracing::debug!(error = %source, "listing again page by page");
                    return Ok(pager.list(dir).await?);
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(out)
    }

    /// The keys of every object under `dir`. A file in a `file://` store whose name is no
    /// object key is logged and left out: nothing etcd-warden writes is named so, and it must
    /// not stop the listing of what is.
    pub async fn keys_under(&self, dir: &Path) -> Result<Vec<Path>, StoreError> {
        let mut keys = Vec::new();
        for entry in self.objects_under(&format!("{dir}/")).await? {
            match entry {
                local::Entry::Object { key, .. } => keys.push(Path::from(key)),
                local::Entry::Unnamed { key, reason, .. } => {
                    tracing::warn!(key, reason, "not an object of this store, ignored");
                }
            }
        }
        Ok(keys)
    }

    /// Whether any object is under `dir`, as [`SnapshotStore::keys_under`] lists them; from a
    /// cloud store the first object of the listing answers, the rest is not read.
    pub async fn any_under(&self, dir: &Path) -> Result<bool, StoreError> {
        if self.local_root.is_some() {
            return Ok(!self.keys_under(dir).await?.is_empty());
        }
        match self.store.list(Some(dir)).next().await {
            None => Ok(false),
            Some(Ok(_)) => Ok(true),
            // A key that is no object key in the first page: listed as keys_under lists.
            Some(Err(object_store::Error::InvalidPath { .. })) if self.pager.is_some() => {
                Ok(!self.keys_under(dir).await?.is_empty())
            }
            Some(Err(e)) => Err(e.into()),
        }
    }

    /// The latest full snapshot and every later delta.
    pub async fn latest_chain(&self) -> Result<Chain, StoreError> {
        Ok(layout::latest_chain(&self.list().await?))
    }

    /// Uploads a payload as a multipart upload with bounded memory. An error item in `data`
    /// (e.g. a failed hash check) or a failed part aborts the upload, so nothing partial becomes
    /// visible; so does dropping the future before the completion is sent (a timeout, a
    /// cancelled snapshot): the store keeps no parts of an abandoned upload. Returns the number
    /// of bytes stored.
    pub async fn put_stream(
        &self,
        snapshot: &Snapshot,
        mut data: ByteStream,
    ) -> Result<u64, StoreError> {
        let path = self.path_of(snapshot);
        let upload = self.store.put_multipart(&path).await?;
        let mut upload = AbortOnDrop {
            writer: Some(WriteMultipart::new_with_chunk_size(upload, self.part_size)),
            path: path.clone(),
        };
        let mut written = 0u64;
        let failure = loop {
            let Some(writer) = upload.writer.as_mut() else {
                unreachable!("the writer is taken only to finish or abort");
            };
            match data.next().await {
                Some(Ok(chunk)) => {
                    if let Err(e) = writer.wait_for_capacity(PARTS_IN_FLIGHT).await {
                        break StoreError::Backend(e);
                    }
                    written += chunk.len() as u64;
                    writer.put(chunk);
                }
                Some(Err(e)) => break StoreError::Payload(e),
                None => {
                    // From here the completion may reach the store even if this future is
                    // dropped; the name is the caller's to make that harmless (the hand-off's
                    // final is written under one name fixed before its first attempt).
                    if let Some(writer) = upload.writer.take() {
                        writer.finish().await?;
                    }
                    self.retain(snapshot).await?;
                    return Ok(written);
                }
            }
        };
        if let Some(writer) = upload.writer.take()
            && let Err(e) = writer.abort().await
        {
            tracing::warn!(key = %path, error = %e, "aborting the failed upload failed");
        }
        Err(failure)
    }

    /// Uploads a payload of unknown length: with one PUT when it ends within a part, else as
    /// [`SnapshotStore::put_stream`] does (what was read first goes first). Either way memory
    /// stays within a few parts, and an error item in `data` leaves nothing at the destination.
    /// Returns the bytes stored.
    pub async fn put_stream_small_as_one(
        &self,
        snapshot: &Snapshot,
        mut data: ByteStream,
    ) -> Result<u64, StoreError> {
        let mut head = Vec::new();
        let mut len = 0;
        while len <= self.part_size {
            match data.next().await {
                Some(Ok(chunk)) => {
                    len += chunk.len();
                    head.push(chunk);
                }
                Some(Err(e)) => return Err(StoreError::Payload(e)),
                None => {
                    let payload: PutPayload = head.into_iter().collect();
                    self.store.put(&self.path_of(snapshot), payload).await?;
                    self.retain(snapshot).await?;
                    return Ok(len as u64);
                }
            }
        }
        let rest = futures::stream::iter(head.into_iter().map(Ok)).chain(data);
        self.put_stream(snapshot, Box::pin(rest)).await
    }

    /// Uploads a payload of exactly `len` bytes: in one streamed request where the store has
    /// [`SinglePut`] and `len` is within its limit, else as [`SnapshotStore::put_stream`] does.
    /// Either way an error item in `data` leaves nothing at the destination. Returns the bytes
    /// stored.
    pub async fn put_stream_sized(
        &self,
        snapshot: &Snapshot,
        data: ByteStream,
        len: u64,
    ) -> Result<u64, StoreError> {
        match &self.single_put {
            Some(single) if single.takes(len) => {
                single.put(&self.path_of(snapshot), len, data).await?;
                self.retain(snapshot).await?;
                Ok(len)
            }
            _ => self.put_stream(snapshot, data).await,
        }
    }

    /// Stores a small payload (a delta) in one request.
    pub async fn put_bytes(&self, snapshot: &Snapshot, data: Bytes) -> Result<(), StoreError> {
        self.store
            .put(&self.path_of(snapshot), PutPayload::from_bytes(data))
            .await?;
        self.retain(snapshot).await
    }

    /// The stored (compressed) payload as a stream.
    pub async fn get_stream(&self, snapshot: &Snapshot) -> Result<ByteStream, StoreError> {
        let res = self.store.get(&self.path_of(snapshot)).await?;
        Ok(res
            .into_stream()
            .map(|r| r.map_err(std::io::Error::other))
            .boxed())
    }

    /// The payload, decrypted (when encrypted) and decompressed, as a stream. Without an
    /// identity an encrypted snapshot fails here, before anything is read.
    pub async fn get_decoded(&self, snapshot: &Snapshot) -> Result<ByteStream, StoreError> {
        Ok(self.get_decoded_sized(snapshot).await?.0)
    }

    /// [`SnapshotStore::get_decoded`], with the size the object is stored at (what bounds a
    /// delta's inflated size before it is read: [`crate::snapshot::delta::read_all`]).
    pub async fn get_decoded_sized(
        &self,
        snapshot: &Snapshot,
    ) -> Result<(ByteStream, u64), StoreError> {
        let identities = match snapshot.encrypted {
            true => Some(self.identities(snapshot)?),
            false => None,
        };
        let got = self.store.get(&self.path_of(snapshot)).await?;
        let stored_size = got.meta.size;
        let bound = self.bound_of(snapshot, stored_size);
        let stored = got
            .into_stream()
            .map(|r| r.map_err(std::io::Error::other))
            .boxed();
        let compressed = match identities {
            Some(ids) => encryption::decrypt(stored, ids),
            None => stored,
        };
        let limit = bound.limit;
        let decoded =
            compression::bounded(snapshot.compression.decode(compressed), limit, move || {
                bound.clone().into_io()
            });
        Ok((decoded, stored_size))
    }

    /// The most `snapshot`, stored in `stored` bytes, may decompress to, as the error that
    /// says so: a delta [`ReadLimits::max_delta_size`], a full snapshot
    /// [`ReadLimits::full_bound`] of its stored size.
    pub fn bound_of(&self, snapshot: &Snapshot, stored: u64) -> Oversized {
        let limits = self.read_limits;
        let (limit, why, key) = match snapshot.kind {
            Kind::Incr => (
                limits.max_delta_size,
                "the most any delta may".to_string(),
                "restore.max_delta_size",
            ),
            Kind::Full => {
                let limit = limits.full_bound(stored);
                let ratio = limits.max_inflation_ratio;
                let why = match limit > limits.min_full_bound {
                    true => format!("{ratio} times the {stored} bytes stored"),
                    false => format!(
                        "the floor of every full snapshot; {ratio} times the {stored} bytes \
                         stored is less"
                    ),
                };
                (limit, why, "restore.max_inflation_ratio")
            }
        };
        Oversized {
            snapshot: snapshot.snap_name.clone(),
            limit,
            why,
            key,
        }
    }

    /// Deletes a snapshot.
    pub async fn delete(&self, snapshot: &Snapshot) -> Result<(), StoreError> {
        self.store.delete(&self.path_of(snapshot)).await?;
        Ok(())
    }

    /// Where [`SnapshotStore::set_aside`] keeps snapshots of history `label`:
    /// `<prefix>/etcd-warden/diverged/<label>/`.
    pub fn aside_prefix(&self, label: &str) -> String {
        let prefix = self.prefix.trim_matches('/');
        let base = format!("etcd-warden/diverged/{label}/");
        if prefix.is_empty() {
            base
        } else {
            format!("{prefix}/{base}")
        }
    }

    /// Moves `snapshot` out of the layout (copied under [`SnapshotStore::aside_prefix`], then
    /// deleted), so no restore or retention sees it and nothing of it is lost. A snapshot
    /// already gone (an earlier, interrupted move) is not an error.
    pub async fn set_aside(&self, snapshot: &Snapshot, label: &str) -> Result<(), StoreError> {
        let from = self.path_of(snapshot);
        let to = Path::from(format!(
            "{}{}",
            self.aside_prefix(label),
            snapshot.snap_name
        ));
        match self.store.copy(&from, &to).await {
            Ok(()) => {}
            Err(object_store::Error::NotFound { .. }) => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        self.store.delete(&from).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config(url: &str) -> StoreConfig {
        StoreConfig::at(StoreLocation::parse(url).unwrap())
    }

    #[test]
    fn prefixed_provider_variables_win() {
        let env: HashMap<String, String> = [
            ("AWS_REGION", "eu-west-1"),
            ("SOURCE_AWS_REGION", "us-east-2"),
            ("AWS_ENDPOINT", "http://plain"),
            ("GOOGLE_BUCKET", "g"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let got = provider_env(&env, Some("SOURCE_"), "AWS_");
        assert_eq!(
            got,
            vec![
                ("AWS_ENDPOINT".to_string(), "http://plain".to_string()),
                ("AWS_REGION".to_string(), "us-east-2".to_string()),
            ]
        );
        let plain = provider_env(&env, None, "AWS_");
        assert!(plain.contains(&("AWS_REGION".to_string(), "eu-west-1".to_string())));
    }

    #[test]
    fn s3_explicit_configuration_wins_over_the_environment() {
        use object_store::aws::AmazonS3ConfigKey as K;
        let vars: Vec<(String, String)> = [
            ("AWS_ENDPOINT", "http://from-env:9000"),
            ("AWS_REGION", "eu-central-1"),
            ("AWS_ACCESS_KEY_ID", "env-id"),
            ("AWS_VIRTUAL_HOSTED_STYLE_REQUEST", "true"),
            ("AWS_NOT_A_KEY", "ignored"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let env_only = config("s3://bkt/p");
        let explicit = StoreConfig {
            endpoint: Some("http://127.0.0.1:9000".into()),
            region: Some("us-east-2".into()),
            path_style: false,
            access_key_id: Some(Secret::Value("cfg-id".into())),
            secret_access_key: Some(Secret::Value("cfg-key".into())),
            ..config("s3://bkt/p")
        };
        // (configuration, environment, keys the builder must hold)
        type Case<'a> = (&'a StoreConfig, &'a [(String, String)], &'a [(K, &'a str)]);
        let cases: [Case; 3] = [
            (
                &env_only,
                &vars,
                &[
                    (K::Endpoint, "http://from-env:9000"),
                    (K::Region, "eu-central-1"),
                    (K::AccessKeyId, "env-id"),
                    // The default path_style leaves the environment's choice alone.
                    (K::VirtualHostedStyleRequest, "true"),
                ],
            ),
            (
                &explicit,
                &vars,
                &[
                    (K::Endpoint, "http://127.0.0.1:9000"),
                    (K::Region, "us-east-2"),
                    (K::AccessKeyId, "cfg-id"),
                    (K::Bucket, "bkt"),
                ],
            ),
            // Without the environment, path-style is the default (S3-compatible services).
            (&env_only, &[], &[(K::VirtualHostedStyleRequest, "false")]),
        ];
        for (cfg, vars, want) in cases {
            let b = s3_builder(cfg, "bkt", vars).unwrap();
            for (key, value) in want {
                assert_eq!(b.get_config_value(key).as_deref(), Some(*value), "{key:?}");
            }
        }
    }

    /// Local stores upload in small parts (memory), cloud stores in S3's minimum; an object of
    /// several local parts reads back whole.
    #[tokio::test]
    async fn part_size_follows_the_location() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}", dir.path().display());
        let store = SnapshotStore::from_config(&config(&url)).unwrap();
        assert_eq!(store.part_size, LOCAL_PART_SIZE);
        let s3 = SnapshotStore::at(
            Arc::new(object_store::memory::InMemory::new()),
            &StoreLocation::parse("s3://bkt/p").unwrap(),
        );
        assert_eq!(s3.part_size, PART_SIZE);

        let payload: Vec<u8> = (0..(LOCAL_PART_SIZE * 5 / 2)).map(|i| i as u8).collect();
        let snap = Snapshot::new("", Kind::Full, 0, 7, chrono::Utc::now(), Codec::None, false);
        let chunks: Vec<std::io::Result<Bytes>> = payload
            .chunks(100_000)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let written = store
            .put_stream(&snap, futures::stream::iter(chunks).boxed())
            .await
            .unwrap();
        assert_eq!(written, payload.len() as u64);
        let mut back = Vec::new();
        let mut stream = store.get_stream(&snap).await.unwrap();
        while let Some(chunk) = stream.next().await {
            back.extend_from_slice(&chunk.unwrap());
        }
        assert_eq!(back, payload);
    }

    #[test]
    fn builds_every_provider_offline() {
        let env: HashMap<String, String> = HashMap::new();
        let mut s3 = config("s3://bkt/pre");
        s3.endpoint = Some("http://127.0.0.1:1".into());
        s3.allow_http = true;
        s3.access_key_id = Some(Secret::Value("id".into()));
        s3.secret_access_key = Some(Secret::Value("key".into()));
        assert!(build_with_env(&s3, &env, None).is_ok());
        s3.secret_access_key = None;
        let e = build_with_env(&s3, &env, None).unwrap_err().to_string();
        assert!(e.contains("both"), "{e}");

        let mut az = config("az://cont/pre");
        az.account_name = Some("acct".into());
        az.account_key = Some(Secret::Value("a2V5".into()));
        assert!(build_with_env(&az, &env, None).is_ok());

        // GCS: a service account file is parsed at build time; a broken one is reported.
        let dir = tempfile::tempdir().unwrap();
        let sa = dir.path().join("sa.json");
        std::fs::write(&sa, "not json").unwrap();
        let mut gs = config("gs://b/p");
        gs.service_account_file = Some(sa.clone());
        let e = build_with_env(&gs, &env, None).unwrap_err().to_string();
        assert!(e.contains("gs://b/p"), "{e}");
    }

    #[test]
    fn gcs_service_account_from_config_or_environment() {
        let dir = tempfile::tempdir().unwrap();
        // A key that never signs anything (no request is made): object_store's test form.
        let good = dir.path().join("good.json");
        std::fs::write(
            &good,
            r#"{"private_key": "k", "private_key_id": "id", "client_email": "sa@example.invalid", "disable_oauth": true, "gcs_base_url": "http://127.0.0.1:1"}"#,
        )
        .unwrap();
        let missing = dir.path().join("missing.json");
        let env_with = |path: &std::path::Path| -> HashMap<String, String> {
            [(
                "GOOGLE_SERVICE_ACCOUNT".to_string(),
                path.display().to_string(),
            )]
            .into_iter()
            .collect()
        };
        let mut gs = config("gs://bucket/prefix");
        // From the environment alone.
        assert!(build_with_env(&gs, &env_with(&good), None).is_ok());
        let e = build_with_env(&gs, &env_with(&missing), None).unwrap_err();
        assert!(e.to_string().contains("missing.json"), "{e}");
        // The configured file wins over the environment's, and is watched for rotation.
        gs.service_account_file = Some(good.clone());
        let store = build_with_env(&gs, &env_with(&missing), None).unwrap();
        assert!(store.to_string().starts_with("Reloading("), "{store}");
        // The copy job's SOURCE_ prefix selects the source's own variable.
        gs.service_account_file = None;
        let mut env = env_with(&missing);
        env.insert(
            "SOURCE_GOOGLE_SERVICE_ACCOUNT".into(),
            good.display().to_string(),
        );
        assert!(build_with_env(&gs, &env, Some("SOURCE_")).is_ok());
        assert!(build_with_env(&gs, &env, None).is_err());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_listed_snapshot_can_be_written_to_another_store() {
        let backend: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let src = SnapshotStore::new(backend.clone(), "source/a");
        let dst = SnapshotStore::new(backend.clone(), "dest");
        let s = src.new_snapshot(Kind::Full, 0, 7, Codec::None, true);
        src.put_bytes(&s, Bytes::from_static(b"payload"))
            .await
            .unwrap();
        let listed = src.list().await.unwrap().remove(0);
        assert_eq!(listed.prefix, "source/a/v2/");
        let data = src.get_stream(&listed).await.unwrap();
        dst.put_stream(&listed, data).await.unwrap();
        let copied = dst.list().await.unwrap();
        assert_eq!(copied, vec![dst.adopt(&listed)]);
        assert_eq!(copied[0].prefix, "dest/v2/");
        assert_eq!(
            dst.path_of(&listed).as_ref(),
            "dest/v2/".to_string() + &s.snap_name
        );
    }

    /// gzip of `len` zeros: a small object that decompresses far beyond its size.
    fn gzip_zeros(len: usize) -> Bytes {
        use std::io::Write as _;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        let block = vec![0u8; 1 << 20];
        let mut left = len;
        while left > 0 {
            let n = left.min(block.len());
            gz.write_all(&block[..n]).unwrap();
            left -= n;
        }
        Bytes::from(gz.finish().unwrap())
    }

    /// A full snapshot is read up to its ratio of its stored size (or the floor), a delta up to
    /// `max_delta_size`; beyond, the read fails with [`Oversized`] naming the snapshot, the
    /// bound and the key, having passed no more than the bound.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn decoding_stops_at_the_configured_bounds() {
        let limits = ReadLimits {
            max_delta_size: 2 << 20,
            max_inflation_ratio: 100,
            min_full_bound: 1 << 20,
        };
        let store = SnapshotStore::new(Arc::new(InMemory::new()), "p").with_read_limits(limits);
        let bomb = gzip_zeros(16 << 20);
        let full = store.new_snapshot(Kind::Full, 0, 7, Codec::Gzip, false);
        store.put_bytes(&full, bomb.clone()).await.unwrap();
        let mut stream = store.get_decoded(&full).await.unwrap();
        let (mut passed, mut error) = (0u64, None);
        while let Some(chunk) = stream.next().await {
            match chunk {
                Ok(b) => passed += b.len() as u64,
                Err(e) => error = Some(e),
            }
        }
        let e = error.expect("the bomb decoded whole");
        let oversized = Oversized::of(&e).expect("an Oversized error").clone();
        let limit = (bomb.len() as u64 * 100).max(1 << 20);
        assert_eq!(oversized.limit, limit);
        assert!(passed <= limit, "{passed} bytes passed");
        assert_eq!(oversized.snapshot, full.snap_name);
        assert_eq!(oversized.key, "restore.max_inflation_ratio");
        assert!(e.to_string().contains("restore.max_inflation_ratio"), "{e}");
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);

        // The same bytes as a delta: its own bound and key.
        let delta = store.new_snapshot(Kind::Incr, 8, 9, Codec::Gzip, false);
        store.put_bytes(&delta, bomb).await.unwrap();
        let e = crate::snapshot::delta::read(&store, &delta)
            .await
            .unwrap_err();
        match &e {
            crate::snapshot::delta::DeltaError::TooLarge(o) => {
                assert_eq!((o.limit, o.key), (2 << 20, "restore.max_delta_size"));
                assert_eq!(o.snapshot, delta.snap_name);
            }
            other => panic!("not TooLarge: {other}"),
        }
        // Within the bounds, both read whole (the floor lets a tiny full snapshot inflate).
        let small = gzip_zeros(1 << 20);
        store.put_bytes(&full, small).await.unwrap();
        let whole = compression::collect(store.get_decoded(&full).await.unwrap()).await;
        assert_eq!(whole.unwrap().len(), 1 << 20);
    }

    #[test]
    fn file_store_creates_its_directory() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("a/b/c");
        let cfg = config(&format!("file://{}", root.display()));
        build_with_env(&cfg, &HashMap::<String, String>::new(), None).unwrap();
        assert!(root.is_dir());
    }
}
