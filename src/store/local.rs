//! Listing a `file://` store directly, one entry at a time.
//!
//! object_store's `LocalFileSystem` turns every file name into an object key; a name that is not
//! valid UTF-8, or holds a control character such as a newline, cannot be one, and the listing
//! yields an error for it and then ends (its stream stops at the first error). One such file,
//! put there by hand, by another tool or by someone hostile, would stop `ls`, restore,
//! `initialize`, `verify` and retention. Here such a name is one entry that is not an object,
//! reported beside the others, and the listing goes on.

use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use object_store::path::Path as ObjectPath;

/// Directory levels followed below the listed directory: snapshots are one level down, chunk
/// objects two; the bound only keeps a symlink loop from recursing forever.
const MAX_DEPTH: usize = 16;

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

/// Every file under `root/dir` (recursively, following symlinks as `LocalFileSystem` does),
/// as [`Entry`]s; a missing directory is empty. In-progress uploads (`<name>#<digits>`, which
/// `LocalFileSystem` writes before the rename) are skipped as it skips them.
pub fn list(root: &Path, dir: &str) -> std::io::Result<Vec<Entry>> {
    let mut out = Vec::new();
    let start = root.join(dir.trim_matches('/'));
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
}
