//! An object store in front of a real one that loses answers: the store performs the request
//! and the client never hears so (a connection cut after the server committed), or the store
//! completes an upload long after the client gave up on it, single PUTs and multipart uploads
//! alike; or that refuses uploads, as a store that is down. Only for the objects a test names
//! (by a suffix of their key), a set number of times; everything else passes through.
//!
//! This is the fault at the I/O seam the sidecar uses (`object_store`), in front of a real S3
//! server: what it does not model is how a particular HTTP client retries below that seam.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use object_store::path::Path;
use object_store::{
    GetOptions, GetResult, MultipartUpload, ObjectStore, PutMultipartOptions, PutOptions,
    PutPayload, PutResult, UploadPart,
};

/// What happens to a completion of an upload whose key ends with the suffix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    /// The store completes it; the client gets an error instead of the answer.
    Answer,
    /// The client waits forever; the store completes it after this long.
    Late(Duration),
    /// The store refuses it: nothing is written, the client gets an error (a store that is down).
    Refused,
}

/// A store that loses the next `times` completions of uploads to keys ending in `suffix`.
#[derive(Debug)]
pub struct LosingStore {
    inner: Arc<dyn ObjectStore>,
    suffix: String,
    loss: Loss,
    left: Arc<AtomicU32>,
    /// Completions lost so far.
    pub lost: Arc<AtomicU32>,
}

impl LosingStore {
    pub fn new(inner: Arc<dyn ObjectStore>, suffix: &str, loss: Loss, times: u32) -> Self {
        LosingStore {
            inner,
            suffix: suffix.into(),
            loss,
            left: Arc::new(AtomicU32::new(times)),
            lost: Arc::new(AtomicU32::new(0)),
        }
    }

    /// The loss for an upload to `location`, counting it: one of the next `times` uploads to a
    /// key ending in the suffix.
    fn lose(&self, location: &Path) -> Option<Loss> {
        let lose = location.as_ref().ends_with(&self.suffix)
            && self
                .left
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
        lose.then_some(self.loss)
    }

    /// Loses the next `times` uploads to keys ending in the suffix (0: none from now on).
    pub fn lose_next(&self, times: u32) {
        self.left.store(times, Ordering::SeqCst);
    }

    /// How many completions were lost so far.
    pub fn lost(&self) -> u32 {
        self.lost.load(Ordering::SeqCst)
    }
}

impl fmt::Display for LosingStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LosingStore({})", self.inner)
    }
}

struct LosingUpload {
    inner: Option<Box<dyn MultipartUpload>>,
    lose: Option<Loss>,
    lost: Arc<AtomicU32>,
}

impl fmt::Debug for LosingUpload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LosingUpload({:?})", self.lose)
    }
}

fn refused_error() -> object_store::Error {
    object_store::Error::Generic {
        store: "LosingStore",
        source: "connection refused".into(),
    }
}

fn lost_error() -> object_store::Error {
    object_store::Error::Generic {
        store: "LosingStore",
        source: "the connection was cut before the answer arrived".into(),
    }
}

#[async_trait]
impl MultipartUpload for LosingUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        match self.inner.as_mut() {
            Some(inner) => inner.put_part(data),
            None => Box::pin(async { Err(lost_error()) }),
        }
    }

    async fn complete(&mut self) -> object_store::Result<PutResult> {
        let Some(mut inner) = self.inner.take() else {
            return Err(lost_error());
        };
        match self.lose {
            None => inner.complete().await,
            Some(Loss::Refused) => Err(refused_error()),
            Some(Loss::Answer) => {
                inner.complete().await?;
                self.lost.fetch_add(1, Ordering::SeqCst);
                Err(lost_error())
            }
            Some(Loss::Late(after)) => {
                let lost = self.lost.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    if inner.complete().await.is_ok() {
                        lost.fetch_add(1, Ordering::SeqCst);
                    }
                });
                std::future::pending().await
            }
        }
    }

    async fn abort(&mut self) -> object_store::Result<()> {
        match self.inner.as_mut() {
            Some(inner) => inner.abort().await,
            None => Ok(()),
        }
    }
}

super::forward::object_store_passing_the_rest!(LosingStore, inner, {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        match self.lose(location) {
            None => self.inner.put_opts(location, payload, opts).await,
            Some(Loss::Refused) => Err(refused_error()),
            Some(Loss::Answer) => {
                self.inner.put_opts(location, payload, opts).await?;
                self.lost.fetch_add(1, Ordering::SeqCst);
                Err(lost_error())
            }
            Some(Loss::Late(after)) => {
                let (inner, location, lost) =
                    (self.inner.clone(), location.clone(), self.lost.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    if inner.put_opts(&location, payload, opts).await.is_ok() {
                        lost.fetch_add(1, Ordering::SeqCst);
                    }
                });
                std::future::pending().await
            }
        }
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        let lose = self.lose(location);
        if lose == Some(Loss::Refused) {
            return Err(refused_error());
        }
        let inner = self.inner.put_multipart_opts(location, opts).await?;
        Ok(Box::new(LosingUpload {
            inner: Some(inner),
            lose,
            lost: self.lost.clone(),
        }))
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.inner.get_opts(location, options).await
    }
});
