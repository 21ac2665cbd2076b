//! Listing a `file://` store directly, one entry at a time.
//!
//! object_store's `LocalFileSystem` turns every file name into an object key; a name that is not
//! valid UTF-8, or holds a control character such as a newline, cannot be one, and the listing
//! yields an error for it and then ends (its stream stops at the first error). One such file,
//! put there by hand, by another tool or by someone hostile, would stop `ls`, restore,
//! `initialize`, `verify` and retention. Here such a name is one entry that is not an object,
//! reported beside the others, and the listing goes on.
//!
//! A symbolic link to a directory is an entry too, never followed: three links `v2/x -> .`
//! made a walk that followed them visit 3^16 paths. And the store's own directories below its
//! root (`v2`, `etcd-warden`, …) must be real directories of this process's user
//! ([`own_dirs`]): one that is a link, or another user's, could lead the store into a
//! directory it does not own (to be written into, made 0700, or read as snapshots).

use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use object_store::path::Path as ObjectPath;

/// Directory levels walked below the listed directory: snapshots are one level down, chunk
/// objects two; the bound keeps a crafted deep tree from costing without end.
const MAX_DEPTH: usize = 16;

/// Why a directory of a `file://` store below its root is refused.
#[derive(Debug, thiserror::Error)]
pub enum DirError {
    /// It is a symbolic link: it could lead anywhere, into another user's directory too.
    #[error(
        "store directory {} is a symbolic link (to {target}); the directories a store keeps \
         below its root must be real directories, so it is not followed",
        path.display()
    )]
    Symlink {
        /// The directory.
        path: PathBuf,
        /// Where the link points.
        target: String,
    },
    /// Another user owns it (pre-created in a shared root such as `/tmp`): its owner could
    /// read, replace or fill what the store keeps there.
    #[error(
        "store directory {} is owned by uid {owner}, not by this process's uid {uid}; a \
         directory another user made is not used (remove it, or give the store a root of its \
         own)",
        path.display()
    )]
    Foreign {
        /// The directory.
        path: PathBuf,
        /// Its owner's uid.
        owner: u32,
        /// This process's effective uid.
        uid: u32,
    },
    /// It is not a directory.
    #[error("store directory {} is not a directory", path.display())]
    NotDir {
        /// The path.
        path: PathBuf,
    },
    /// It could not be read or created.
    #[error("store directory {}: {source}", path.display())]
    Io {
        /// The directory.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

impl From<DirError> for std::io::Error {
    fn from(e: DirError) -> std::io::Error {
        let kind = match &e {
            DirError::Io { source, .. } => source.kind(),
            _ => std::io::ErrorKind::PermissionDenied,
        };
        std::io::Error::new(kind, e)
    }
}

/// Checks every directory from below `root` down to `dir` (which is under `root`): each must
/// be a real directory (no symbolic link) owned by this process's effective user. With
/// `create`, a missing one is created with that mode; without, a missing one ends the check
/// with `Ok(false)` (nothing below it exists). `root` itself is the administrator's choice
/// and is not checked: it may be a link (a volume mounted elsewhere) or another user's.
pub fn own_dirs(root: &Path, dir: &Path, create: Option<u32>) -> Result<bool, DirError> {
    let Ok(below) = dir.strip_prefix(root) else {
        return Err(DirError::Io {
            path: dir.to_path_buf(),
            source: std::io::Error::other(format!("not under the store's root {}", root.display())),
        });
    };
    let uid = nix::unistd::geteuid().as_raw();
    let mut path = root.to_path_buf();
    for part in below.components() {
        path.push(part);
        let meta = match std::fs::symlink_metadata(&path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let Some(mode) = create else {
                    return Ok(false);
                };
                let mut builder = std::fs::DirBuilder::new();
                std::os::unix::fs::DirBuilderExt::mode(&mut builder, mode);
                match builder.create(&path) {
                    Ok(()) => {}
                    // Made by someone else since: checked below as any existing one.
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                    Err(source) => return Err(DirError::Io { path, source }),
                }
                std::fs::symlink_metadata(&path).map_err(|source| DirError::Io {
                    path: path.clone(),
                    source,
                })?
            }
            Err(source) => return Err(DirError::Io { path, source }),
        };
        if meta.file_type().is_symlink() {
            let target = std::fs::read_link(&path)
                .map(|t| escaped(&t))
                .unwrap_or_else(|e| format!("unreadable: {e}"));
            return Err(DirError::Symlink { path, target });
        }
        if !meta.is_dir() {
            return Err(DirError::NotDir { path });
        }
        if meta.uid() != uid {
            return Err(DirError::Foreign {
                path,
                owner: meta.uid(),
                uid,
            });
        }
    }
    Ok(true)
}

/// One file found under the listed directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// A file whose name is a valid object key.
    Object {
        /// Its key, relative to the store's root.
        key: String,
        /// Its size in bytes.
        size: u64,
    },
    /// A file whose name is not a valid object key.
    Unnamed {
        /// Its path relative to the store's root, non-ASCII and control bytes escaped (`\n`,
        /// `\xff`), so it prints on one line and cannot pass for another name.
        key: String,
        /// Its size in bytes.
        size: u64,
        /// Why it is not an object key.
        reason: String,
    },
}

/// Every file under `root/dir` (recursively; a symbolic link to a file is followed as
/// `LocalFileSystem` follows it, one to a directory is an [`Entry::Unnamed`]), as [`Entry`]s;
/// a missing directory is empty, one that [`own_dirs`] refuses an error. In-progress uploads
/// (`<name>#<digits>`, which `LocalFileSystem` writes before the rename) are skipped as it
/// skips them.
pub fn list(root: &Path, dir: &str) -> std::io::Result<Vec<Entry>> {
    let mut out = Vec::new();
    let start = root.join(dir.trim_matches('/'));
    if !own_dirs(root, &start, None)? {
        return Ok(out);
    }
    walk(root, &start, 0, &mut out)?;
    Ok(out)
}

fn walk(root: &Path, dir: &Path, depth: usize, out: &mut Vec<Entry>) -> std::io::Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let path = entry?.path();
        let meta = match std::fs::metadata(&path) {
            Ok(meta) => meta,
            // Removed since it was read, or a broken symlink: not an object.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        if meta.is_dir() && is_link(&path)? {
            let relative = path.strip_prefix(root).unwrap_or(&path);
            out.push(Entry::Unnamed {
                key: escaped(relative),
                size: 0,
                reason: "a symbolic link to a directory, not followed (a store's objects are \
                         files in its own directories; a link could loop or lead elsewhere)"
                    .to_string(),
            });
            continue;
        }
        if meta.is_dir() {
            if depth < MAX_DEPTH {
                walk(root, &path, depth + 1, out)?;
            }
            continue;
        }
        if !meta.is_file() {
            continue;
        }
        let relative = path.strip_prefix(root).unwrap_or(&path).to_path_buf();
        if let Some(entry) = entry_for(&relative, meta.len()) {
            out.push(entry);
        }
    }
    Ok(())
}

/// Whether `path` is a symbolic link (gone since it was read: not one).
fn is_link(path: &Path) -> std::io::Result<bool> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) => Ok(meta.file_type().is_symlink()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// The entry of the file at `relative` (to the store's root); `None` for an in-progress upload.
fn entry_for(relative: &Path, size: u64) -> Option<Entry> {
    let unnamed = |reason: &str| Entry::Unnamed {
        key: escaped(relative),
        size,
        reason: reason.to_string(),
    };
    let Some(text) = relative.to_str() else {
        return Some(unnamed(
            "the name is not valid UTF-8, so it is no object key",
        ));
    };
    let key = match ObjectPath::parse(text) {
        Ok(key) => key,
        Err(_) => {
            return Some(unnamed(
                "the name holds a control character (such as a newline) or an empty, \".\" or \
                 \"..\" segment, so it is no object key",
            ));
        }
    };
    let file = key.filename().unwrap_or_default();
    if let Some((_, suffix)) = file.split_once('#')
        && !suffix.is_empty()
        && suffix.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    Some(Entry::Object {
        key: key.to_string(),
        size,
    })
}

/// `path`'s bytes with everything but printable ASCII escaped.
fn escaped(path: &Path) -> String {
    path.as_os_str().as_bytes().escape_ascii().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn names_that_are_no_keys_are_entries_and_the_listing_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let v2 = dir.path().join("v2");
        std::fs::create_dir_all(v2.join("Full-x")).unwrap();
        std::fs::write(v2.join("good"), b"12345").unwrap();
        std::fs::write(v2.join("Full-x/chunk"), b"1").unwrap();
        std::fs::write(v2.join(OsStr::from_bytes(b"bad\xff")), b"1").unwrap();
        std::fs::write(v2.join("two\nlines"), b"22").unwrap();
        std::fs::write(v2.join("upload#12"), b"1").unwrap();
        std::fs::write(dir.path().join("outside"), b"1").unwrap();
        let mut got = list(dir.path(), "v2/").unwrap();
        got.sort_by(|a, b| format!("{a:?}").cmp(&format!("{b:?}")));
        let keys: Vec<(&str, u64)> = got
            .iter()
            .map(|e| match e {
                Entry::Object { key, size } | Entry::Unnamed { key, size, .. } => {
                    (key.as_str(), *size)
                }
            })
            .collect();
        assert_eq!(
            keys,
            vec![
                ("v2/Full-x/chunk", 1),
                ("v2/good", 5),
                ("v2/bad\\xff", 1),
                ("v2/two\\nlines", 2)
            ]
        );
        assert!(matches!(&got[2], Entry::Unnamed { reason, .. } if reason.contains("UTF-8")));
        assert!(matches!(&got[3], Entry::Unnamed { reason, .. } if reason.contains("newline")));
        assert_eq!(list(dir.path(), "nothing/").unwrap(), vec![]);
    }

    fn keys(entries: &[Entry]) -> Vec<String> {
        let mut keys: Vec<String> = entries
            .iter()
            .map(|e| match e {
                Entry::Object { key, .. } => format!("object {key}"),
                Entry::Unnamed { key, .. } => format!("unnamed {key}"),
            })
            .collect();
        keys.sort();
        keys
    }

    /// A symbolic link to a directory is listed as an entry, never walked: one `v2/x -> .`
    /// listed every file 17 times, three made the walk visit 3^16 paths (RSS rising past 900
    /// MB).
    #[test]
    fn symlinked_directories_are_entries_not_walked() {
        let dir = tempfile::tempdir().unwrap();
        let v2 = dir.path().join("v2");
        std::fs::create_dir_all(v2.join("Full-x")).unwrap();
        std::fs::write(v2.join("good"), b"1").unwrap();
        std::fs::write(v2.join("Full-x/chunk"), b"1").unwrap();
        std::os::unix::fs::symlink(".", v2.join("a")).unwrap();
        let want = |links: &[&str]| {
            let mut want: Vec<String> =
                vec!["object v2/Full-x/chunk".into(), "object v2/good".into()];
            want.extend(links.iter().map(|l| format!("unnamed v2/{l}")));
            want.sort();
            want
        };
        assert_eq!(keys(&list(dir.path(), "v2/").unwrap()), want(&["a"]));
        std::os::unix::fs::symlink(".", v2.join("b")).unwrap();
        std::os::unix::fs::symlink("..", v2.join("Full-x/c")).unwrap();
        let got = list(dir.path(), "v2/").unwrap();
        assert_eq!(keys(&got), want(&["a", "b", "Full-x/c"]));
        assert!(got.iter().all(|e| match e {
            Entry::Unnamed { reason, .. } => reason.contains("symbolic link"),
            Entry::Object { .. } => true,
        }));
    }

    /// The listed directory itself, or one above it below the root, that is a link or another
    /// user's is refused by name (the listing would read another user's files as snapshots);
    /// the root may be a link.
    #[test]
    fn a_listed_directory_that_is_a_link_or_another_users_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::create_dir(&victim).unwrap();
        std::fs::write(victim.join("Full-00000000-00000001-1700000000"), b"1").unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir(&root).unwrap();
        std::os::unix::fs::symlink(&victim, root.join("v2")).unwrap();
        let e = list(&root, "v2/").unwrap_err().to_string();
        assert!(e.contains(&format!("{}/v2", root.display())), "{e}");
        assert!(e.contains("symbolic link"), "{e}");

        // The root a link to a store: used as it is.
        let linked = dir.path().join("linked");
        std::os::unix::fs::symlink(&victim, &linked).unwrap();
        assert_eq!(
            keys(&list(&linked, "").unwrap()),
            vec!["object Full-00000000-00000001-1700000000".to_string()]
        );

        if nix::unistd::geteuid().is_root() {
            let other = dir.path().join("other");
            std::fs::create_dir_all(other.join("v2")).unwrap();
            std::fs::write(other.join("v2/Full-00000000-00000001-1700000000"), b"1").unwrap();
            std::os::unix::fs::chown(other.join("v2"), Some(65534), Some(65534)).unwrap();
            let e = list(&other, "v2/").unwrap_err().to_string();
            assert!(e.contains(&format!("{}/v2", other.display())), "{e}");
            assert!(e.contains("owned by uid 65534"), "{e}");
        }
    }
}
