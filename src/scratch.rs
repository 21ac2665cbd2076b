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
//! [`ScratchDir`] removes its directory on every exit path (it is a drop guard), and is reached
//! through a descriptor rather than its name, so that in a parent others may write to (an
//! `emptyDir` is 0777 without the sticky bit) a directory swapped in under its name is never
//! written into nor removed.

use std::ffi::OsString;
use std::fs::{DirBuilder, File, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat};
use nix::sys::stat::{Mode, fchmod, fstat, fstatat, mkdirat};
use nix::unistd::{UnlinkatFlags, geteuid, unlinkat};

/// Mode of every scratch directory.
pub const DIR_MODE: u32 = 0o700;
/// Mode of every scratch file.
pub const FILE_MODE: u32 = 0o600;

/// Opens `parent` to make a scratch directory in (following a symlink: the operator named it).
fn open_parent(parent: &Path) -> io::Result<OwnedFd> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_DIRECTORY)
        .open(parent)?;
    Ok(OwnedFd::from(file))
}

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
///
/// It is opened once, right after `mkdir`, and every path it hands out ([`ScratchDir::path`])
/// goes through that descriptor (`/proc/self/fd/<n>`), never through its name again: where the
/// parent is writable by others without the sticky bit (an `emptyDir`, mode 0777), anyone may
/// rename the directory and put one of their own at its name, and a name would then lead into
/// theirs. The descriptor is inherited by child processes (etcd's tools, a temporary etcd), so
/// the same path leads them there too. Dropping it empties the directory through the
/// descriptor and removes the directory itself only where it is now (found by its inode in the
/// parent it was made in), never whatever holds its name.
#[derive(Debug)]
pub struct ScratchDir {
    /// The directory, opened without close-on-exec so that children resolve `path` alike.
    dir: OwnedFd,
    /// The parent it was made in, held so that cleanup looks there and not wherever the
    /// parent's name leads by then.
    parent: OwnedFd,
    /// Its name in `parent` when it was made.
    name: OsString,
    /// `/proc/self/fd/<dir>`: the directory whatever its name.
    path: PathBuf,
    /// Where it was made, for messages.
    shown: PathBuf,
}

impl ScratchDir {
    /// Creates `<parent>/<prefix><random>`, 0700, trying another suffix while the name is
    /// taken; `parent` (and its missing parents) is created 0700 if missing.
    pub fn new_in(parent: &Path, prefix: &str) -> io::Result<ScratchDir> {
        create_private_dirs(parent)?;
        let parent_fd = open_parent(parent)?;
        for _ in 0..ATTEMPTS {
            let name = OsString::from(format!("{prefix}{:016x}", unpredictable()));
            match mkdirat(
                &parent_fd,
                name.as_os_str(),
                Mode::from_bits_truncate(DIR_MODE),
            ) {
                Ok(()) => return ScratchDir::anchor(parent_fd, parent, name),
                Err(Errno::EEXIST) => continue,
                Err(e) => return Err(io::Error::from(e)),
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
        let (parent, name) = match (path.parent(), path.file_name()) {
            (Some(p), Some(n)) => (
                if p.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    p
                },
                n,
            ),
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{} names no directory to create", path.display()),
                ));
            }
        };
        let parent_fd = open_parent(parent)?;
        mkdirat(&parent_fd, name, Mode::from_bits_truncate(DIR_MODE)).map_err(io::Error::from)?;
        ScratchDir::anchor(parent_fd, parent, name.to_owned())
    }

    /// Opens the directory just made as `name` in `parent` and checks it is the one made: ours,
    /// and empty. In between, another user who may write to the parent could have put theirs
    /// there; that is refused (and the name left alone: it is not ours any more).
    fn anchor(parent: OwnedFd, parent_path: &Path, name: OsString) -> io::Result<ScratchDir> {
        let shown = parent_path.join(&name);
        let replaced = || {
            io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!(
                    "{} was replaced between its creation and its opening: another user can write to {}",
                    shown.display(),
                    parent_path.display()
                ),
            )
        };
        // No O_CLOEXEC: children inherit it, and so resolve `/proc/self/fd/<n>` alike.
        let dir = openat(
            &parent,
            name.as_os_str(),
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW,
            Mode::empty(),
        )
        .map_err(|e| match e {
            Errno::ELOOP | Errno::ENOTDIR | Errno::ENOENT => replaced(),
            e => io::Error::from(e),
        })?;
        let stat = fstat(&dir).map_err(io::Error::from)?;
        if stat.st_uid != geteuid().as_raw() {
            return Err(replaced());
        }
        let path = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()));
        // Through the descriptor: this needs /proc, and finds the directory empty (one of ours
        // swapped in would not be).
        let mut entries = std::fs::read_dir(&path).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "cannot open the scratch directory {} through {} (is /proc mounted?): {e}",
                    shown.display(),
                    path.display()
                ),
            )
        })?;
        if entries.next().is_some() {
            return Err(replaced());
        }
        // The mode asked of mkdir, whatever the umask took from it.
        fchmod(&dir, Mode::from_bits_truncate(DIR_MODE)).map_err(io::Error::from)?;
        Ok(ScratchDir {
            dir,
            parent,
            name,
            path,
            shown,
        })
    }

    /// The directory, as a path that leads to it whatever happens to its name (through
    /// `/proc/self/fd`); valid for this process and its children while `self` lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where it was made (`<parent>/<name>`), for messages: not a way to reach it.
    pub fn shown(&self) -> &Path {
        &self.shown
    }

    /// Empties the directory through its descriptor.
    fn empty(&self) -> io::Result<()> {
        for entry in std::fs::read_dir(&self.path)? {
            let entry = entry?;
            let inner = self.path.join(entry.file_name());
            // Not followed: a symlink in it is removed, not what it points to.
            match std::fs::symlink_metadata(&inner) {
                Ok(m) if m.is_dir() => std::fs::remove_dir_all(&inner)?,
                Ok(_) => std::fs::remove_file(&inner)?,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// The directory's name in its parent now: the one it was made under, or the one it was
    /// renamed to; `None` when it left the parent.
    fn current_name(&self) -> io::Result<Option<OsString>> {
        let own = fstat(&self.dir).map_err(io::Error::from)?;
        let ours = |name: &std::ffi::OsStr| {
            fstatat(&self.parent, name, AtFlags::AT_SYMLINK_NOFOLLOW)
                .is_ok_and(|s| (s.st_dev, s.st_ino) == (own.st_dev, own.st_ino))
        };
        if ours(&self.name) {
            return Ok(Some(self.name.clone()));
        }
        let parent = PathBuf::from(format!("/proc/self/fd/{}", self.parent.as_raw_fd()));
        for entry in std::fs::read_dir(parent)? {
            let name = entry?.file_name();
            if ours(&name) {
                return Ok(Some(name));
            }
        }
        Ok(None)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let warn = |what: &str, e: &dyn std::fmt::Display| tracing::warn!(path = %self.shown.display(), error = %e, "{what}");
        if let Err(e) = self.empty() {
            warn("removing a scratch directory's contents failed", &e);
            return;
        }
        match self.current_name() {
            Ok(Some(name)) => {
                if name != self.name {
                    tracing::warn!(
                        path = %self.shown.display(),
                        renamed_to = %self.shown.with_file_name(&name).display(),
                        "a scratch directory was renamed while in use (another user can write to its parent); it was used and removed where it is now"
                    );
                }
                // Only an empty directory goes, so a swap between the check and here removes
                // nothing of anyone's.
                if let Err(e) = unlinkat(&self.parent, name.as_os_str(), UnlinkatFlags::RemoveDir) {
                    warn("removing a scratch directory failed", &e);
                }
            }
            Ok(None) => warn(
                "a scratch directory left its parent while in use; emptied, not removed",
                &"moved away",
            ),
            Err(e) => warn("looking for a scratch directory in its parent failed", &e),
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
        assert_ne!(a.shown(), b.shown());
        assert_eq!(mode(a.shown()), 0o700);
        assert!(std::fs::metadata(a.path()).unwrap().is_dir());
        assert_eq!(mode(&parent), 0o700, "a missing parent is created private");
        let file = a.path().join("f");
        create_private_file(&file).unwrap();
        assert_eq!(mode(&file), 0o600);
        let log = a.path().join("log");
        drop(append_private_file(&log).unwrap());
        assert_eq!(mode(&log), 0o600);
        let kept = a.shown().to_path_buf();
        drop(a);
        assert!(!kept.exists());
        assert!(b.shown().exists());
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

    /// Another user who may write to the parent (0777, not sticky: what an `emptyDir` is)
    /// renames the fresh directory and puts one of their own at its name. What is written
    /// afterwards, by this process or a child given the path, still lands in ours, and cleanup
    /// removes ours where it is now and nothing of theirs.
    #[test]
    fn a_directory_swapped_under_its_name_is_neither_written_nor_removed() {
        use std::io::Write as _;
        let dir = tempfile::tempdir().unwrap();
        let parent = dir.path().join("shared");
        std::fs::create_dir(&parent).unwrap();
        std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o777)).unwrap();
        for made_by_name in [false, true] {
            let scratch = match made_by_name {
                false => ScratchDir::new_in(&parent, "x-").unwrap(),
                true => ScratchDir::create(&parent.join("data.restore-work")).unwrap(),
            };
            let listed: Vec<PathBuf> = std::fs::read_dir(&parent)
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            let [made] = listed.as_slice() else {
                panic!("{listed:?}")
            };
            let moved = parent.join("moved-away");
            std::fs::rename(made, &moved).unwrap();
            std::fs::create_dir(made).unwrap();
            std::fs::write(made.join("theirs"), b"theirs").unwrap();

            create_private_file(&scratch.path().join("restored.db"))
                .unwrap()
                .write_all(b"plaintext")
                .unwrap();
            create_private_dir(&scratch.path().join("sub")).unwrap();
            let child = std::process::Command::new("sh")
                .args(["-c", "echo child > \"$1\"/sub/log", "sh"])
                .arg(scratch.path())
                .status()
                .unwrap();
            assert!(child.success());
            assert_eq!(
                std::fs::read(moved.join("restored.db")).unwrap(),
                b"plaintext"
            );
            assert_eq!(std::fs::read(moved.join("sub/log")).unwrap(), b"child\n");
            let theirs: Vec<_> = std::fs::read_dir(made).unwrap().collect();
            assert_eq!(theirs.len(), 1, "nothing written into theirs: {theirs:?}");

            drop(scratch);
            assert!(!moved.exists(), "ours is removed where it is now");
            assert_eq!(std::fs::read(made.join("theirs")).unwrap(), b"theirs");
            std::fs::remove_dir_all(made).unwrap();
        }
    }
}
