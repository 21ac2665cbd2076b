//! An etcd member's database file read without etcd: what a restore wrote, compared with what
//! etcd served.

use std::collections::BTreeMap;
use std::path::Path;

use etcd_warden::restore::bolt::Reader;
use etcd_warden::restore::direct::decode_kv;

/// A key as etcd serves it: key, value, create revision, mod revision, version.
pub type Kv = (Vec<u8>, Vec<u8>, i64, i64, i64);

/// The live keys of an etcd database file, read from its `key` bucket without etcd: every
/// revision record in order, a tombstone removing its key.
pub fn live_keys(db: &Path) -> Vec<Kv> {
    let len = std::fs::metadata(db).unwrap().len();
    let reader = Reader::open(db, len).unwrap_or_else(|e| panic!("{}: {e}", db.display()));
    let buckets = reader.buckets().unwrap();
    let key = buckets
        .iter()
        .find(|b| b.name == b"key")
        .expect("key bucket");
    let mut live: BTreeMap<Vec<u8>, Kv> = BTreeMap::new();
    reader
        .visit(&key.root, &mut |_, rev, value| {
            // A revision bump's record holds nothing.
            if value.is_empty() {
                return Ok(());
            }
            let kv = decode_kv(value)?;
            // A revision key is 17 bytes, 18 with the tombstone mark.
            if rev.len() == 18 && rev[17] == b't' {
                live.remove(&kv.key);
            } else {
                live.insert(
                    kv.key.clone(),
                    (
                        kv.key,
                        kv.value,
                        kv.create_revision,
                        kv.mod_revision,
                        kv.version,
                    ),
                );
            }
            Ok(())
        })
        .unwrap();
    live.into_values().collect()
}
