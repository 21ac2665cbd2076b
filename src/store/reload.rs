//! A backend rebuilt when one of its credential files changes: for providers whose builder reads
//! a credential file once (GCS's service account), so a rotated file is used without a restart.
//! Each operation costs one `stat` per file; a rebuild that fails keeps the previous backend (and
//! is retried on the next operation).

use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use super::credentials::{Stamp, file_stamp};
use async_trait::async_trait;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};

type Build = dyn Fn() -> Result<Arc<dyn ObjectStore>> + Send + Sync;

fn stamps(files: &[PathBuf]) -> Vec<Stamp> {
    files.iter().map(|p| file_stamp(p)).collect()
}

/// An object store that rebuilds itself when its credential files change.
pub struct Reloading {
    files: Vec<PathBuf>,
    build: Box<Build>,
    state: Mutex<(Vec<Stamp>, Arc<dyn ObjectStore>)>,
}

impl Reloading {
    /// Builds once now (an error here is a configuration error) and again whenever one of
    /// `files` changes.
    pub fn new(
        files: Vec<PathBuf>,
        build: impl Fn() -> Result<Arc<dyn ObjectStore>> + Send + Sync + 'static,
    ) -> Result<Reloading> {
        let seen = stamps(&files);
        let store = build()?;
        Ok(Reloading {
            files,
            build: Box::new(build),
            state: Mutex::new((seen, store)),
        })
    }

    /// The backend for this operation, rebuilt first if a file changed.
    pub fn current(&self) -> Arc<dyn ObjectStore> {
        let now = stamps(&self.files);
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.0 != now {
            match (self.build)() {
                Ok(store) => {
                    tracing::info!(files = ?self.files, "credential file changed: store rebuilt");
                    *state = (now, store);
                }
                Err(e) => {
                    tracing::warn!(files = ?self.files, error = %e, "credential file changed but the store cannot be rebuilt; keeping the previous one");
                }
            }
        }
        state.1.clone()
    }
}

impl fmt::Debug for Reloading {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reloading")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

impl fmt::Display for Reloading {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Reloading({})", self.current())
    }
}

#[async_trait]
impl ObjectStore for Reloading {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        self.current().put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.current().put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.current().get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        self.current().delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        self.current().list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.current().list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.current().copy_opts(from, to, options).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::ObjectStoreExt;
    use object_store::memory::InMemory;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn rebuilds_when_a_file_changes_and_keeps_the_old_store_on_failure() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("sa.json");
        std::fs::write(&file, "v1").unwrap();
        let builds = Arc::new(AtomicUsize::new(0));
        let counter = builds.clone();
        let watched = file.clone();
        let r = Reloading::new(vec![file.clone()], move || {
            counter.fetch_add(1, Ordering::SeqCst);
            match std::fs::read_to_string(&watched) {
                Ok(s) if s.starts_with('v') => {
                    Ok(Arc::new(InMemory::new()) as Arc<dyn ObjectStore>)
                }
                _ => Err(object_store::Error::Generic {
                    store: "test",
                    source: "unreadable service account".into(),
                }),
            }
        })
        .unwrap();
        let p = Path::from("x");
        r.put(&p, PutPayload::from_static(b"1")).await.unwrap();
        assert_eq!(builds.load(Ordering::SeqCst), 1, "no change, no rebuild");
        // A rewritten file (different length, whatever the mtime granularity) rebuilds: the
        // new in-memory backend does not have the object.
        std::fs::write(&file, "v2-rotated").unwrap();
        assert!(r.get(&p).await.is_err());
        assert_eq!(builds.load(Ordering::SeqCst), 2);
        r.put(&p, PutPayload::from_static(b"2")).await.unwrap();
        // A broken file keeps the previous backend, and is retried each time.
        std::fs::write(&file, "broken!!!!!!!!").unwrap();
        assert!(r.get(&p).await.is_ok());
        assert!(r.get(&p).await.is_ok());
        assert_eq!(builds.load(Ordering::SeqCst), 4);
    }
}
