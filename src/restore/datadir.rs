//! What an existing etcd data directory holds, read before etcd starts on it: missing, corrupt,
//! or a database at a revision.
//!
//! bbolt keeps no page checksums, so no check finds every damaged byte: what is checked is the
//! structure etcd depends on. [`Validation::Sanity`] reads the meta pages (magic, version,
//! checksum, and that the pages they count fit in the file: a truncated file fails here), the
//! root page listing the buckets, and the rightmost path of the `key` bucket to read the revision
//! (a few pages, whatever the database's size). [`Validation::Full`] also walks every page of
//! every bucket (each reached once, each a branch or a leaf, its elements inside it, keys in
//! strictly ascending order, no nested bucket) and decodes every revision record of the `key`
//! bucket (its bbolt key a revision, its value a `mvccpb.KeyValue` of that revision): a damaged
//! page anywhere in a tree, or a damaged record, fails; a changed byte inside a value's payload
//! does not.

use std::path::Path;

use super::bolt::{BoltError, Reader, Root};
use super::direct::database_revision;
pub use crate::config::Validation;

/// The bbolt file of a data directory.
const DB: &str = "member/snap/db";
/// etcd's bucket of revisions.
const KEY_BUCKET: &[u8] = b"key";
/// etcd's bucket of bookkeeping (`consistent_index`, compaction marks).
const META_BUCKET: &[u8] = b"meta";

/// What a data directory holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataDir {
    /// Nothing of etcd's: the directory is absent, empty, or has no `member` directory (a
    /// volume's `lost+found`, say), where etcd would start a new member.
    Missing,
    /// Something etcd should not start on; why.
    Corrupt(String),
    /// A database that passed validation, at this revision (as etcd would start on it).
    Valid {
        /// The database's revision.
        revision: i64,
        /// Raft entries in the WAL past the database's consistent index: etcd applies them on
        /// start (a crash before the database's periodic commit, or entries that write no key:
        /// elections, membership, leases). Each adds at most one revision, so the member starts
        /// at `revision + wal_ahead` at most.
        wal_ahead: u64,
    },
}

/// Whether etcd has `dir`'s database open: bbolt holds an exclusive `flock` on
/// `member/snap/db` for as long as it is open (in this pod's other container as well: the lock
/// is on the file).
#[derive(Debug)]
pub enum DbLock {
    /// No database file: nothing can be running on the directory.
    Absent,
    /// The lock is ours until this is dropped: etcd cannot open the database meanwhile.
    Held(nix::fcntl::Flock<std::fs::File>),
    /// Someone (etcd) holds it: the directory is in use and must be left alone.
    Busy,
}

/// Tries to take the database's lock without waiting.
pub fn lock_db(dir: &Path) -> Result<DbLock, String> {
    let path = dir.join(DB);
    let file = match std::fs::OpenOptions::new().read(true).open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(DbLock::Absent),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(DbLock::Held(lock)),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(DbLock::Busy),
        Err((_, e)) => Err(format!("locking {}: {e}", path.display())),
    }
}

/// Reads `dir` as [`Validation`] says (blocking: call it off the async runtime).
pub fn check(dir: &Path, mode: Validation) -> DataDir {
    match std::fs::read_dir(dir).map(|mut entries| entries.next().is_some()) {
        Ok(true) => {}
        Ok(false) => return DataDir::Missing,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return DataDir::Missing,
        Err(e) => return DataDir::Corrupt(format!("{}: {e}", dir.display())),
    }
    if !dir.join("member").exists() {
        return DataDir::Missing;
    }
    match check_present(dir, mode) {
        Ok((revision, wal_ahead)) => DataDir::Valid {
            revision,
            wal_ahead,
        },
        Err(reason) => DataDir::Corrupt(reason),
    }
}

fn check_present(dir: &Path, mode: Validation) -> Result<(i64, u64), String> {
    for sub in ["member/snap", "member/wal"] {
        if !dir.join(sub).is_dir() {
            return Err(format!("no {sub} directory"));
        }
    }
    // etcd treats a WAL directory without a segment as no WAL at all: a new member.
    let has_wal = std::fs::read_dir(dir.join("member/wal"))
        .map_err(|e| format!("member/wal: {e}"))?
        .filter_map(Result::ok)
        .any(|e| e.file_name().to_string_lossy().ends_with(".wal"));
    if !has_wal {
        return Err("no WAL segment (*.wal) in member/wal".into());
    }
    let db = dir.join(DB);
    let len = std::fs::metadata(&db)
        .map_err(|e| format!("{DB}: {e}"))?
        .len();
    let (revision, consistent_index) =
        database(&db, len, mode).map_err(|e| format!("{DB}: {e}"))?;
    // A WAL that cannot be read is etcd's to judge (it repairs a torn tail); counted as not
    // ahead, so the revision decides.
    let wal_ahead = match super::wal::last_entry_index(&dir.join("member/wal")) {
        Ok(Some(last)) => last.saturating_sub(consistent_index),
        Ok(None) => 0,
        Err(e) => {
            tracing::warn!(error = %e, "reading the WAL's last entry failed");
            0
        }
    };
    Ok((revision, wal_ahead))
}

/// Validates the bbolt file at `path` (its first `len` bytes) as etcd's database; its revision
/// and its consistent index (the last raft entry applied to it; 0 when not recorded).
pub fn database(path: &Path, len: u64, mode: Validation) -> Result<(i64, u64), BoltError> {
    let reader = Reader::open(path, len)?;
    let buckets = reader.buckets()?;
    for name in [KEY_BUCKET, META_BUCKET] {
        if !buckets.iter().any(|b| b.name == name) {
            return Err(BoltError::Corrupt(format!(
                "no `{}` bucket",
                String::from_utf8_lossy(name)
            )));
        }
    }
    let revision = database_revision(&reader, &buckets).map_err(as_corrupt)?;
    let meta = buckets
        .iter()
        .find(|b| b.name == META_BUCKET)
        .expect("checked above");
    let consistent_index = match reader
        .get(&meta.root, b"consistent_index")
        .map_err(as_corrupt)?
    {
        Some(v) if v.len() == 8 => u64::from_be_bytes(v[..].try_into().expect("8 bytes")),
        Some(v) => {
            return Err(BoltError::Corrupt(format!(
                "meta consistent_index has {} bytes, not 8",
                v.len()
            )));
        }
        None => 0,
    };
    if mode == Validation::Full {
        for bucket in &buckets {
            walk(&reader, &bucket.name, &bucket.root)?;
        }
    }
    Ok((revision, consistent_index))
}

/// In an existing data directory, a shape the reader does not know is damage, not a variant.
fn as_corrupt(e: BoltError) -> BoltError {
    match e {
        BoltError::Unsupported(m) => BoltError::Corrupt(m),
        e => e,
    }
}

/// Every element of one bucket: in order, no nested bucket, and for `key` each a revision record.
fn walk(reader: &Reader, name: &[u8], root: &Root) -> Result<(), BoltError> {
    let bucket = String::from_utf8_lossy(name).into_owned();
    let is_key = name == KEY_BUCKET;
    let mut previous: Option<Vec<u8>> = None;
    reader
        .visit(root, &mut |flags, k, v| {
            if flags != 0 {
                return Err(BoltError::Corrupt(format!(
                    "bucket {bucket}: an element with flags {flags:#x} (etcd nests no buckets)"
                )));
            }
            if previous.as_deref().is_some_and(|p| p >= k) {
                return Err(BoltError::Corrupt(format!(
                    "bucket {bucket}: keys out of order"
                )));
            }
            if is_key {
                revision_record(k, v).map_err(|e| {
                    BoltError::Corrupt(format!("bucket key: record {}: {e}", hex(k)))
                })?;
            }
            previous = Some(k.to_vec());
            Ok(())
        })
        .map_err(as_corrupt)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A record of the `key` bucket: the key is (main `u64` BE, `_`, sub `u64` BE, optional `t`),
/// the value a `mvccpb.KeyValue` with a key and, unless a tombstone, this main revision; or
/// nothing, a revision bump's record.
fn revision_record(key: &[u8], value: &[u8]) -> Result<(), String> {
    let tombstone = match key.len() {
        17 => false,
        18 if key[17] == b't' => true,
        _ => return Err("not a revision key".into()),
    };
    if key[8] != b'_' {
        return Err("not a revision key".into());
    }
    let main = i64::from_be_bytes(key[..8].try_into().map_err(|_| "short key")?);
    // A revision bump's record: no value at all, at sub revision 0, as etcd's own
    // `--bump-revision` writes it (and this crate's restore, after etcd) so that etcd starts at
    // that revision; it stays until a compaction passes it.
    if value.is_empty() && !tombstone && key[9..17] == [0; 8] {
        return Ok(());
    }
    let (kv_key, mod_revision) = key_value(value)?;
    if kv_key.is_empty() {
        return Err("a value without a key".into());
    }
    if !tombstone && mod_revision != main {
        return Err(format!(
            "the value's mod revision {mod_revision} is not its key's {main}"
        ));
    }
    Ok(())
}

/// The key (field 1) and mod revision (field 3) of a protobuf `mvccpb.KeyValue`.
fn key_value(mut b: &[u8]) -> Result<(&[u8], i64), String> {
    let (mut key, mut mod_revision) = (&b""[..], 0i64);
    while !b.is_empty() {
        let tag = varint(&mut b)?;
        match tag & 7 {
            0 => {
                let v = varint(&mut b)?;
                if tag >> 3 == 3 {
                    mod_revision = v as i64;
                }
            }
            2 => {
                let len = usize::try_from(varint(&mut b)?).map_err(|_| "a huge length")?;
                let field = b.get(..len).ok_or("a field past the value's end")?;
                if tag >> 3 == 1 {
                    key = field;
                }
                b = &b[len..];
            }
            wire => return Err(format!("protobuf wire type {wire} in a KeyValue")),
        }
    }
    Ok((key, mod_revision))
}

fn varint(b: &mut &[u8]) -> Result<u64, String> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (&byte, rest) = b.split_first().ok_or("a varint past the value's end")?;
        *b = rest;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err("a varint longer than 10 bytes".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::restore::bolt::{Bucket, NewFile};
    use crate::restore::direct::{encode_kv, revision_key};

    /// A data directory whose database holds `revisions` puts of key `k`, page size 4096.
    fn data_dir(dir: &Path, revisions: i64) -> std::path::PathBuf {
        std::fs::create_dir_all(dir.join("member/snap")).unwrap();
        std::fs::create_dir_all(dir.join("member/wal")).unwrap();
        std::fs::write(
            dir.join("member/wal/0000000000000000-0000000000000000.wal"),
            b"",
        )
        .unwrap();
        let db = dir.join(DB);
        let mut w = NewFile::create(&db, 4096).unwrap();
        let mut roots = Vec::new();
        let mut key = w.tree();
        for rev in 2..=revisions + 1 {
            let value = vec![b'v'; 200];
            key.push(
                &revision_key(rev, 0, false),
                &encode_kv(b"k", 2, rev, rev - 1, &value),
            )
            .unwrap();
        }
        roots.push(Bucket::paged(KEY_BUCKET, key.finish().unwrap()));
        let mut meta = w.tree();
        meta.push(b"consistent_index", &7u64.to_be_bytes()).unwrap();
        roots.push(Bucket::paged(META_BUCKET, meta.finish().unwrap()));
        w.finish(&roots, 1).unwrap();
        db
    }

    #[test]
    fn a_good_directory_is_valid_at_its_last_revision_in_both_modes() {
        let dir = tempfile::tempdir().unwrap();
        data_dir(dir.path(), 500);
        for mode in [Validation::Sanity, Validation::Full] {
            assert_eq!(
                check(dir.path(), mode),
                DataDir::Valid {
                    revision: 501,
                    wal_ahead: 0
                }
            );
        }
    }

    #[test]
    fn absent_or_empty_is_missing_and_a_partial_layout_is_corrupt() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            check(&dir.path().join("nope"), Validation::Sanity),
            DataDir::Missing
        );
        assert_eq!(check(dir.path(), Validation::Sanity), DataDir::Missing);
        std::fs::create_dir_all(dir.path().join("lost+found")).unwrap();
        assert_eq!(check(dir.path(), Validation::Sanity), DataDir::Missing);
        std::fs::create_dir_all(dir.path().join("member")).unwrap();
        assert!(
            matches!(check(dir.path(), Validation::Sanity), DataDir::Corrupt(w) if w.contains("member/snap"))
        );
        std::fs::create_dir_all(dir.path().join("member/snap")).unwrap();
        std::fs::create_dir_all(dir.path().join("member/wal")).unwrap();
        let why = |d: DataDir| match d {
            DataDir::Corrupt(why) => why,
            other => panic!("{other:?}"),
        };
        assert!(why(check(dir.path(), Validation::Sanity)).contains("WAL"));
        std::fs::write(dir.path().join("member/wal/0-0.wal"), b"").unwrap();
        assert!(why(check(dir.path(), Validation::Sanity)).contains("member/snap/db"));
    }

    #[test]
    fn a_truncated_database_is_corrupt_in_both_modes() {
        let dir = tempfile::tempdir().unwrap();
        let db = data_dir(dir.path(), 500);
        let len = std::fs::metadata(&db).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&db)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
        for mode in [Validation::Sanity, Validation::Full] {
            assert!(
                matches!(check(dir.path(), mode), DataDir::Corrupt(ref w) if w.contains("pages")),
                "{mode:?}"
            );
        }
    }

    /// A damaged leaf away from the rightmost path: sanity does not read it, full does.
    #[test]
    fn a_flipped_byte_in_an_inner_leaf_is_found_by_full_only() {
        for what in ["page flags", "a record's key"] {
            let dir = tempfile::tempdir().unwrap();
            let db = data_dir(dir.path(), 500);
            let mut bytes = std::fs::read(&db).unwrap();
            // The first leaf holds revision 2, the leftmost record of the `key` bucket.
            let at = bytes
                .windows(17)
                .position(|w| w == revision_key(2, 0, false).as_slice())
                .unwrap();
            // The leaf's flags (0x02 becomes 0x00), or the `_` of that record's key.
            let target = match what {
                "page flags" => at / 4096 * 4096 + 8,
                _ => at + 8,
            };
            bytes[target] ^= 0x02;
            std::fs::write(&db, &bytes).unwrap();
            assert_eq!(
                check(dir.path(), Validation::Sanity),
                DataDir::Valid {
                    revision: 501,
                    wal_ahead: 0
                },
                "{what}"
            );
            assert!(
                matches!(check(dir.path(), Validation::Full), DataDir::Corrupt(_)),
                "{what}"
            );
        }
    }

    /// `etcdutl snapshot restore --bump-revision` and this crate's bump end the `key` bucket
    /// with an empty record: etcd starts at its revision, and full validation must accept it
    /// (it took every bumped restore for corrupt).
    #[test]
    fn a_bumped_database_is_valid_in_full_at_the_bumped_revision() {
        let dir = tempfile::tempdir().unwrap();
        let db = data_dir(dir.path(), 50);
        std::fs::remove_file(&db).unwrap();
        let mut w = NewFile::create(&db, 4096).unwrap();
        let mut key = w.tree();
        for rev in 2..=51 {
            key.push(
                &revision_key(rev, 0, false),
                &encode_kv(b"k", 2, rev, rev - 1, b"v"),
            )
            .unwrap();
        }
        key.push(&revision_key(1051, 0, false), b"").unwrap();
        let mut roots = vec![Bucket::paged(KEY_BUCKET, key.finish().unwrap())];
        let mut meta = w.tree();
        meta.push(b"consistent_index", &7u64.to_be_bytes()).unwrap();
        roots.push(Bucket::paged(META_BUCKET, meta.finish().unwrap()));
        w.finish(&roots, 1).unwrap();
        for mode in [Validation::Sanity, Validation::Full] {
            assert_eq!(
                check(dir.path(), mode),
                DataDir::Valid {
                    revision: 1051,
                    wal_ahead: 0
                },
                "{mode:?}"
            );
        }
    }

    #[test]
    fn a_record_whose_value_disagrees_with_its_key_is_corrupt_in_full() {
        assert!(
            revision_record(&revision_key(5, 0, false), &encode_kv(b"k", 5, 5, 1, b"v")).is_ok()
        );
        assert!(revision_record(&revision_key(5, 1, true), &encode_kv(b"k", 0, 0, 0, b"")).is_ok());
        assert!(
            revision_record(&revision_key(5, 0, false), &encode_kv(b"k", 5, 6, 1, b"v")).is_err()
        );
        assert!(
            revision_record(&revision_key(5, 0, false), &encode_kv(b"", 5, 5, 1, b"v")).is_err()
        );
        assert!(revision_record(b"short", &encode_kv(b"k", 5, 5, 1, b"v")).is_err());
        // A bump's empty record is etcd's own, at sub revision 0 only and never a tombstone.
        assert!(revision_record(&revision_key(1005, 0, false), b"").is_ok());
        assert!(revision_record(&revision_key(1005, 1, false), b"").is_err());
        assert!(revision_record(&revision_key(1005, 0, true), b"").is_err());
        assert!(revision_record(&revision_key(5, 0, false), &[0x0a, 0x05, b'k']).is_err());
    }
}
