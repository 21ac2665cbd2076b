//! `file://` stores readable by their owner alone (`store.private`, on by default): a snapshot
//! is the whole keyspace, so nobody else on the host may read it.
//!
//! [`PrivateFiles`] wraps object_store's `LocalFileSystem`. Before every write it makes the
//! store's root directory 0700 and creates the object's missing parent directories 0700
//! (tightening any existing one under the root); after the write it sets the object's file to
//! 0600. object_store stages each write in a file created with the process umask (usually 0644)
//! and renames it into place, and this wrapper cannot reach that file before the rename. That
//! is safe because the root is 0700 before the write begins: another user cannot traverse into
//! the store, so a file briefly 0644 inside it is unreachable. The process umask is never
//! changed: it belongs to the whole process, not to a library.
//!
//! The store's directories below its root must be its own: a `v2` that is a symbolic link to
//! another directory, or that another user pre-created in a shared root such as `/tmp`, fails
//! every write by name before anything is created, chmodded or written (with `store.private`
//! off too). Once the store made them, no other user can replace them: a sticky root keeps
//! others from renaming them, and what is below them is 0700.

use std::fmt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path as FsPath, PathBuf};

use super::local::own_dirs;
use async_trait::async_trait;
use futures::stream::BoxStream;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions, Result, UploadPart,
};

/// Mode of the store's directories.
pub const DIR_MODE: u32 = 0o700;
/// Mode of every object's file.
pub const FILE_MODE: u32 = 0o600;

/// A local file store whose directories are 0700 and files 0600 (unless made with
/// `private` off), and whose directories below the root are its own ([`own_dirs`]).
#[derive(Debug)]
pub struct PrivateFiles {
    inner: LocalFileSystem,
    root: PathBuf,
    /// Whether modes are set (`store.private`); the directories are checked either way.
    private: bool,
}

impl PrivateFiles {
    /// The store rooted at `root` (which exists).
    pub fn new(root: &FsPath) -> Result<PrivateFiles> {
        PrivateFiles::with_modes(root, true)
    }

    /// The store rooted at `root` (which exists); with `private` off the modes are the
    /// umask's, and only the store's directories are checked before each write.
    pub fn with_modes(root: &FsPath, private: bool) -> Result<PrivateFiles> {
        let inner = LocalFileSystem::new_with_prefix(root)?;
        // The object paths `LocalFileSystem` gives are under its canonical root (that of the
        // empty path is not always: a root reached through a link stays the link).
        let root = inner
            .path_to_filesystem(&Path::from("x"))
            .ok()
            .and_then(|x| x.parent().map(FsPath::to_path_buf))
            .unwrap_or_else(|| root.to_path_buf());
        Ok(PrivateFiles {
            inner,
            root,
            private,
        })
    }

    /// Makes the root and the directories down to `location` private, creating the missing
    /// ones 0700; returns `location`'s file. Run before each write: a root made readable again
    /// since the last one is tightened, or the write fails (never written where others read).
    /// A directory below the root that is a symbolic link or another user's fails the write
    /// before anything is changed ([`own_dirs`]): it is never followed, chmodded or written.
    fn prepare(&self, location: &Path) -> Result<PathBuf> {
        let file = self.inner.path_to_filesystem(location)?;
        if self.private {
            tighten_root(&self.root).map_err(|e| self.error(&self.root, "making private", e))?;
        }
        if let Some(parent) = file.parent() {
            let mode = match self.private {
                true => DIR_MODE,
                false => 0o777,
            };
            own_dirs(&self.root, parent, Some(mode)).map_err(|e| object_store::Error::Generic {
                store: "file",
                source: Box::new(e),
            })?;
            if !self.private {
                return Ok(file);
            }
            // Directories left by an earlier release (or with store.private off) are tightened.
            for dir in parent.ancestors().take_while(|d| *d != self.root) {
                if !dir.starts_with(&self.root) {
                    break;
                }
                tighten(dir).map_err(|e| self.error(dir, "making private", e))?;
            }
        }
        Ok(file)
    }

    /// Sets the written object's file to 0600.
    fn seal(&self, file: &FsPath) -> Result<()> {
        if !self.private {
            return Ok(());
        }
        set_mode(file, FILE_MODE).map_err(|e| self.error(file, "making private", e))
    }

    fn error(&self, path: &FsPath, what: &str, e: std::io::Error) -> object_store::Error {
        object_store::Error::Generic {
            store: "file (store.private)",
            source: format!("{what} {}: {e}", path.display()).into(),
        }
    }
}

/// [`tighten`] for the store's root, unless it is a shared directory (the sticky bit: `/tmp`,
/// a store URL such as `file:///tmp`): closing that would break every other user of it. The
/// store's own directories below it are still made 0700, and every object lives in one of them
/// (`v2/`, `etcd-warden/`).
fn tighten_root(root: &FsPath) -> std::io::Result<()> {
    if std::fs::metadata(root)?.permissions().mode() & 0o1000 != 0 {
        return Ok(());
    }
    tighten(root)
}

/// Sets `dir` to 0700 unless it already is.
fn tighten(dir: &FsPath) -> std::io::Result<()> {
    let mode = std::fs::metadata(dir)?.permissions().mode() & 0o7777;
    if mode != DIR_MODE {
        set_mode(dir, DIR_MODE)?;
    }
    Ok(())
}

fn set_mode(path: &FsPath, mode: u32) -> std::io::Result<()> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

impl fmt::Display for PrivateFiles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.private {
            true => write!(f, "Private({})", self.inner),
            false => write!(f, "{}", self.inner),
        }
    }
}

#[async_trait]
impl ObjectStore for PrivateFiles {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        let file = self.prepare(location)?;
        let put = self.inner.put_opts(location, payload, opts).await?;
        self.seal(&file)?;
        Ok(put)
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        let file = self.prepare(location)?;
        let inner = self.inner.put_multipart_opts(location, opts).await?;
        if !self.private {
            return Ok(inner);
        }
        Ok(Box::new(PrivateUpload {
            inner,
            file,
            root: self.root.clone(),
        }))
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[std::ops::Range<u64>],
    ) -> Result<Vec<bytes::Bytes>> {
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, Result<ObjectMeta>> {
        self.inner.list_with_offset(prefix, offset)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        let file = self.prepare(to)?;
        self.inner.copy_opts(from, to, options).await?;
        self.seal(&file)
    }

    async fn rename_opts(&self, from: &Path, to: &Path, options: RenameOptions) -> Result<()> {
        let file = self.prepare(to)?;
        self.inner.rename_opts(from, to, options).await?;
        self.seal(&file)
    }
}

/// A multipart write whose file is made 0600 once it is complete.
#[derive(Debug)]
struct PrivateUpload {
    inner: Box<dyn MultipartUpload>,
    file: PathBuf,
    root: PathBuf,
}

#[async_trait]
impl MultipartUpload for PrivateUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        self.inner.put_part(data)
    }

    async fn complete(&mut self) -> Result<PutResult> {
        let put = self.inner.complete().await?;
        set_mode(&self.file, FILE_MODE).map_err(|e| object_store::Error::Generic {
            store: "file (store.private)",
            source: format!(
                "making private {} (store {}): {e}",
                self.file.display(),
                self.root.display()
            )
            .into(),
        })?;
        Ok(put)
    }

    async fn abort(&mut self) -> Result<()> {
        self.inner.abort().await
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{StoreConfig, StoreLocation};
    use object_store::ObjectStoreExt as _;
    use std::os::unix::fs::PermissionsExt;

    fn mode(path: &std::path::Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
    }

    /// A shared root (sticky, as `/tmp` is) keeps its mode; the directories the store makes
    /// below it are private, and so is every object.
    #[tokio::test]
    async fn a_shared_root_keeps_its_mode() {
        use super::*;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("shared");
        std::fs::create_dir(&root).unwrap();
        set_mode(&root, 0o1777).unwrap();
        let store = PrivateFiles::new(&root).unwrap();
        store
            .put(&Path::from("v2/Full-x"), PutPayload::from_static(b"x"))
            .await
            .unwrap();
        assert_eq!(mode(&root), 0o1777);
        assert_eq!(mode(&root.join("v2")), DIR_MODE);
        assert_eq!(mode(&root.join("v2/Full-x")), FILE_MODE);
    }

    /// `store.private = false` leaves the store as the umask and its owner make it.
    #[tokio::test]
    async fn off_leaves_the_modes_alone() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("shared");
        std::fs::create_dir(&root).unwrap();
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
        let url = format!("file://{}", root.display());
        let config = StoreConfig {
            private: false,
            ..StoreConfig::at(StoreLocation::parse(&url).unwrap())
        };
        let store = crate::store::build(&config).unwrap();
        let path = object_store::path::Path::from("v2/x");
        store.put(&path, b"x".to_vec().into()).await.unwrap();
        assert_eq!(mode(&root), 0o755);
        let on = crate::store::build(&StoreConfig::at(StoreLocation::parse(&url).unwrap()));
        on.unwrap().put(&path, b"y".to_vec().into()).await.unwrap();
        assert_eq!(
            (
                mode(&root),
                mode(&root.join("v2")),
                mode(&root.join("v2/x"))
            ),
            (0o700, 0o700, 0o600)
        );
    }

    /// A `v2` that is a symbolic link to another directory fails the write naming it: the
    /// directory it leads to keeps its mode and gets nothing (it was made 0700 and written).
    /// With `store.private` off too.
    #[tokio::test]
    async fn a_linked_store_directory_is_not_followed() {
        use super::*;
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::create_dir(&victim).unwrap();
        set_mode(&victim, 0o755).unwrap();
        for private in [true, false] {
            let root = dir.path().join(format!("store-{private}"));
            std::fs::create_dir(&root).unwrap();
            std::os::unix::fs::symlink(&victim, root.join("v2")).unwrap();
            let store = PrivateFiles::with_modes(&root, private).unwrap();
            let e = store
                .put(&Path::from("v2/Full-x"), PutPayload::from_static(b"x"))
                .await
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("{}/v2", store.root.display())), "{e}");
            assert!(e.contains("symbolic link"), "{e}");
            assert_eq!(mode(&victim), 0o755);
            assert_eq!(std::fs::read_dir(&victim).unwrap().count(), 0);
        }
    }

    /// A directory another user made where the store keeps its own (in a shared root such as
    /// `/tmp`) fails the write naming it and its owner, and is left as it is; the root may be
    /// a symbolic link and another user's, and a store this user made earlier stays usable.
    #[tokio::test]
    async fn another_users_store_directory_is_refused() {
        use super::*;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("shared");
        std::fs::create_dir(&root).unwrap();
        set_mode(&root, 0o1777).unwrap();
        // The same user's earlier store (0755, as etcd-backup-restore leaves it), reached
        // through a link at the root.
        std::fs::create_dir_all(root.join("v2")).unwrap();
        set_mode(&root.join("v2"), 0o755).unwrap();
        let linked = dir.path().join("linked");
        std::os::unix::fs::symlink(&root, &linked).unwrap();
        let store = PrivateFiles::new(&linked).unwrap();
        store
            .put(&Path::from("v2/Full-x"), PutPayload::from_static(b"x"))
            .await
            .unwrap();
        assert_eq!(mode(&root.join("v2")), DIR_MODE);
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let theirs = root.join("etcd-warden");
        std::fs::create_dir(&theirs).unwrap();
        set_mode(&theirs, 0o777).unwrap();
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        for private in [true, false] {
            let store = PrivateFiles::with_modes(&root, private).unwrap();
            let e = store
                .put(
                    &Path::from("etcd-warden/fence/x"),
                    PutPayload::from_static(b"x"),
                )
                .await
                .unwrap_err()
                .to_string();
            assert!(e.contains(&theirs.display().to_string()), "{e}");
            assert!(e.contains("owned by uid 65534"), "{e}");
            assert_eq!(mode(&theirs), 0o777);
            assert_eq!(std::fs::read_dir(&theirs).unwrap().count(), 0);
        }
        // The root itself may be another user's: the administrator's choice.
        std::os::unix::fs::chown(&root, Some(65534), Some(65534)).unwrap();
        store
            .put(&Path::from("v2/Full-y"), PutPayload::from_static(b"y"))
            .await
            .unwrap();
    }
}
