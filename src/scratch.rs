//! Private scratch space: the one place directories and files holding etcd's data outside its
//! data directory are created (a restore's work directory, a drill's or a compaction's scratch
//! directory, the fetched snapshot, the restored database).
//!
//! Such data is the whole keyspace in plaintext, even when the store is encrypted, and the
//! places may be shared with other local users (`/tmp`, a work directory others can write to).
//! So every directory is created here fresh (`mkdir`, never "use it if it exists") with mode
//! 0700 from its creation, every file with mode 0600, `O_CREAT|O_EXCL|O_NOFOLLOW`: a name
//! someone else planted beforehand (a directory, a symlink to a file elsewhere) is refused, never
//! followed or reused, and nothing is readable by another user at any moment. A directory with
//! a generated name gets an unpredictable suffix and a new one when the name is taken.
//! [`ScratchDir`] removes its directory on every exit path (it is a drop guard).

use std::fs::{DirBuilder, File, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Mode of every scratch directory.
pub const DIR_MODE: u32 = 0o700;
/// Mode of every scratch file.
pub const FILE_MODE: u32 = 0o600;

/// Names tried before [`ScratchDir::new_in`] gives up: each taken name is another process's
/// directory (or a planted one), so this many in a row means something is wrong.
const ATTEMPTS: usize = 64;

/// Creates the directory `path`, mode 0700; fails with `AlreadyExists` if anything (a
/// directory, a file, a symlink) is there already. Its parent must exist.
pub fn create_private_dir(path: &Path) -> io::Result<()> {
    DirBuilder::new().mode(DIR_MODE).create(path)
}

/// Creates `path` and its missing parents, each created 0700 (existing ones are left as they
/// are): for the parent of a scratch directory, which may be shared on purpose.
pub fn create_private_dirs(path: &Path) -> io::Result<()> {
    DirBuilder::new()
        .mode(DIR_MODE)
        .recursive(true)
        .create(path)
}

/// Creates the file `path` for reading and writing, mode 0600; fails with `AlreadyExists` if
/// anything is there, a symlink included (`O_EXCL` with `O_NOFOLLOW`: never followed).
pub fn create_private_file(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(FILE_MODE)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
}

/// Opens `path` for appending, creating it 0600 if it is missing; a symlink there is refused
/// (`O_NOFOLLOW`). For logs a scratch directory's process writes (a temporary etcd's).
pub fn append_private_file(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .mode(FILE_MODE)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
}

/// A scratch directory created fresh and private, removed with everything in it when dropped.
#[derive(Debug)]
pub struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    /// Creates `<parent>/<prefix><random>`, 0700, trying another suffix while the name is
    /// taken; `parent` (and its missing parents) is created 0700 if missing.
    pub fn new_in(parent: &Path, prefix: &str) -> io::Result<ScratchDir> {
        create_private_dirs(parent)?;
        for _ in 0..ATTEMPTS {
            let path = parent.join(format!("{prefix}{:016x}", unpredictable()));
            match create_private_dir(&path) {
                Ok(()) => return Ok(ScratchDir { path }),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!(
                "{ATTEMPTS} names {prefix}… in {} were all taken",
                parent.display()
            ),
        ))
    }

    /// Creates the directory `path` itself, 0700; fails with `AlreadyExists` if anything is
    /// there (a caller that owns the name removes its own leftovers first).
    pub fn create(path: &Path) -> io::Result<ScratchDir> {
        create_private_dir(path)?;
        Ok(ScratchDir {
            path: path.to_path_buf(),
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        match std::fs::remove_dir_all(&self.path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "removing a scratch directory failed")
            }
        }
    }
}

/// 64 bits another local user cannot predict: SipHash under the keys the standard library
/// draws from the OS's random source, over a per-process counter, the process id and the time.
/// The exclusive `mkdir` is what keeps a planted name out; this only makes planting pointless.
fn unpredictable() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    h.write_u128(now.as_nanos());
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mode(path: &Path) -> u32 {
        std::fs::symlink_metadata(path)
            .unwrap()
            .permissions()
            .mode()
            & 0o7777
    }

    #[test]
    fn a_scratch_directory_is_new_private_and_removed_when_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let parent = dir.path().join("work/deeper");
        let a = ScratchDir::new_in(&parent, "x-").unwrap();
        let b = ScratchDir::new_in(&parent, "x-").unwrap();
        assert_ne!(a.path(), b.path());
        assert_eq!(mode(a.path()), 0o700);
        assert_eq!(mode(&parent), 0o700, "a missing parent is created private");
        let file = a.path().join("f");
        create_private_file(&file).unwrap();
        assert_eq!(mode(&file), 0o600);
        let log = a.path().join("log");
        drop(append_private_file(&log).unwrap());
        assert_eq!(mode(&log), 0o600);
        let kept = a.path().to_path_buf();
        drop(a);
        assert!(!kept.exists());
        assert!(b.path().exists());
    }

    /// Whatever another user planted at a name (a directory, a symlink to a file elsewhere) is
    /// refused, never used or followed, and the file the symlink points to is untouched.
    #[test]
    fn planted_names_are_refused_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"secret").unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
        let link = dir.path().join("expected.db");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let e = create_private_file(&link).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists, "{e}");
        let e = append_private_file(&link).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(nix::libc::ELOOP), "{e}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"secret");

        let planted = dir.path().join("scratch");
        std::fs::create_dir(&planted).unwrap();
        std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = ScratchDir::create(&planted).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        let dir_link = dir.path().join("linked");
        std::os::unix::fs::symlink(&planted, &dir_link).unwrap();
        assert_eq!(
            create_private_dir(&dir_link).unwrap_err().kind(),
            io::ErrorKind::AlreadyExists
        );
        assert!(planted.exists(), "a refused directory is not removed");
    }
}
