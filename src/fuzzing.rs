//! The bodies of the fuzz targets in `fuzz/` (cargo-fuzz, nightly): each takes arbitrary bytes
//! as the store or a disk could hand them over and must end in a named error or a correct
//! result, never a panic, a hang or an allocation beyond a bound of the input's size. They live
//! in the library so the parsers stay private, and so `cargo test --lib fuzzing` runs every
//! committed corpus and regression input (`fuzz/corpus/<target>/`) on stable in CI.
//!
//! A body panics only where the result is wrong (a round trip that does not hold, a decoded
//! stream past its bound, a patched database that no longer checks): that is a finding too.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use crate::restore::bolt::{Incoming, READ_PASSES, READ_SLACK, Reader};
use crate::restore::{direct, wal};
use crate::snapshot::delta;
use crate::store::{Codec, Kind, ReadLimits, SnapshotStore, compression, encryption, layout};

/// A target's body.
pub type Body = fn(&[u8]);

/// Every target, by the name of its file in `fuzz/fuzz_targets/` and `fuzz/corpus/`.
pub const TARGETS: &[(&str, Body)] = &[
    ("layout", layout),
    ("bolt", bolt),
    ("patch", patch),
    ("wal", wal),
    ("delta", delta),
    ("store_decode", store_decode),
    ("age", age),
    ("ebr_secret", ebr_secret),
    ("etcdbrctl_flags", etcdbrctl_flags),
    ("config", config),
];

/// A private scratch directory per process and thread (libFuzzer runs one input at a time per
/// process; `cargo test` runs tests on threads).
fn scratch() -> PathBuf {
    let dir = std::env::temp_dir()
        .join(format!(
            "etcd-warden-fuzz-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ))
        .into_os_string()
        .into_string()
        .unwrap_or_default()
        .replace(['(', ')'], "");
    let dir = PathBuf::from(dir);
    let _ = std::fs::create_dir_all(&dir);
    dir
}

fn write(dir: &Path, name: &str, data: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, data).expect("the fuzz scratch directory is writable");
    path
}

/// One runtime per process for the stream decoders (their blocking threads).
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .max_blocking_threads(2)
            .build()
            .expect("a tokio runtime")
    })
}

/// Snapshot names, one per line (the first line is the store prefix), then the chain rules over
/// those that parse.
pub fn layout(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut lines = text.lines();
    let prefix = lines.next().unwrap_or_default();
    let mut parsed = Vec::new();
    for name in lines {
        if let Ok(s) = layout::Snapshot::parse_name(prefix, name) {
            // What parses formats to a name that parses back to the same snapshot.
            let again = layout::Snapshot::parse_name(prefix, &s.format_name())
                .expect("a formatted name parses");
            assert_eq!(again, s, "{name:?}");
            parsed.push(s);
        }
    }
    layout::sort(&mut parsed);
    let chain = layout::latest_chain(&parsed);
    let _ = layout::first_gap(&chain);
    let _ = layout::fallback_chain(&parsed, &[]);
    for s in parsed.iter().take(4) {
        let _ = layout::chain_to(&parsed, layout::Target::Revision(s.last_revision), &[]);
        let _ = layout::chain_to(&parsed, layout::Target::Time(s.created_on), &[]);
    }
}

/// A bbolt file (the fetched full snapshot): its bytes through the check a restore makes as
/// they arrive ([`Incoming`]: nothing past what the meta pages declare is passed on), then open,
/// check, and walk every bucket. Every walk reads each page at most once (and one page of a range
/// it refuses): a page graph with crafted overflow ranges must not cost a read of the file per
/// page.
pub fn bolt(data: &[u8]) {
    let mut incoming = Incoming::new(0);
    let mut passed = 0usize;
    let mut refused = false;
    for chunk in data.chunks(1000) {
        match incoming.push(chunk) {
            Ok(bytes) => passed += bytes.map_or(0, |b| b.len()),
            Err(_) => {
                refused = true;
                break;
            }
        }
    }
    if !refused && let Ok(rest) = incoming.finish() {
        // Accepted: exactly the declared bytes, all of them passed on.
        assert_eq!(
            passed + rest.len(),
            data.len(),
            "accepted bytes are not all passed on"
        );
    }
    let dir = scratch();
    let path = write(&dir, "bolt.db", data);
    let _ = walk(&path, data.len() as u64);
}

fn walk(path: &Path, len: u64) -> Result<(), crate::restore::bolt::BoltError> {
    let reader = Reader::open(path, len)?;
    // One walk's reads: each page once, and the first page of a range refused as reached twice.
    let once = |what: &str, before: u64| {
        let read = reader.pages_read() - before;
        assert!(
            read <= reader.pages() + 1,
            "{what}: {read} page reads of a {}-page file",
            reader.pages()
        );
    };
    let before = reader.pages_read();
    let checked = reader.check();
    once("check", before);
    let _ = reader.freelist();
    for b in reader.buckets()? {
        let mut n = 0u64;
        let before = reader.pages_read();
        let _ = reader.visit(&b.root, &mut |_, _, _| {
            n += 1;
            Ok(())
        });
        once("visit", before);
        let before = reader.pages_read();
        let _ = reader.last_key(&b.root);
        once("last_key", before);
        let _ = reader.get(&b.root, b"finishedCompactRev");
        let before = reader.pages_read();
        let _ = reader.tree_pages(&b.root);
        once("tree_pages", before);
    }
    // However many buckets share pages, the reader's reads stay within its bound.
    assert!(
        reader.pages_read() <= READ_PASSES * reader.pages() + READ_SLACK,
        "{} page reads of a {}-page file",
        reader.pages_read(),
        reader.pages()
    );
    checked.map(drop)
}

/// A bbolt file patched in place with a few events after its revision: a database that checks
/// before the patch checks after it.
pub fn patch(data: &[u8]) {
    let dir = scratch();
    let path = write(&dir, "snapshot.db", data);
    let out = dir.join("patched.db");
    let len = data.len() as u64;
    let Ok(reader) = Reader::open(&path, len) else {
        return;
    };
    let sound = reader.check().is_ok();
    let revision = reader
        .buckets()
        .ok()
        .and_then(|b| direct::database_revision(&reader, &b).ok());
    drop(reader);
    let next = revision.unwrap_or(1).saturating_add(1);
    let time = chrono::DateTime::from_timestamp(1_700_000_000, 0).unwrap_or_default();
    let events = (0..3)
        .map(|i| delta::TimedEvent {
            event: delta::Event {
                kind: delta::EventType::Put,
                kv: Some(delta::KeyValue {
                    key: format!("fuzz/{i}").into_bytes(),
                    value: vec![b'v'; 100],
                    create_revision: next + i,
                    mod_revision: next + i,
                    version: 1,
                    lease: 0,
                }),
                prev_kv: None,
            },
            time,
        })
        .collect();
    let done = direct::write_events(&path, len, &out, events, direct::Plan::default());
    if let (true, Ok(direct::Outcome::Done { .. })) = (sound, &done) {
        let len = std::fs::metadata(&out).map_or(0, |m| m.len());
        if let Err(e) = Reader::open(&out, len).and_then(|r| r.check().map(drop)) {
            panic!("a database that checked does not check once patched: {e}");
        }
    }
}

/// A WAL segment (the newest, then an older one) and the last entry's index.
pub fn wal(data: &[u8]) {
    let _ = wal::last_in_segment(data);
    for newest in [true, false] {
        let mut state = wal::WalState::default();
        let _ = wal::read_segment(data, newest, &mut 0, &mut state);
        let _ = state.committed();
        let _ = state.term_at(state.committed());
    }
}

/// A delta payload (etcd-backup-restore's event JSON and its SHA-256): as stored, and with its
/// hash made right so the JSON is what is fuzzed. What decodes encodes and decodes back alike.
pub fn delta(data: &[u8]) {
    use sha2::{Digest, Sha256};
    let _ = delta::decode(data);
    let mut hashed = data.to_vec();
    hashed.extend_from_slice(&Sha256::digest(data));
    if let Ok(events) = delta::decode(&hashed) {
        let again = delta::encode(&events).expect("decoded events encode");
        assert_eq!(
            delta::decode(&again).expect("encoded events decode"),
            events
        );
    }
}

/// A stored object read as each codec (gzip, zlib, Go's LZW, none) through
/// [`SnapshotStore::get_decoded`] with its bound, as a full snapshot and as a delta: no more
/// than the bound passes, and what passes is what the codec makes of the bytes.
pub fn store_decode(data: &[u8]) {
    const LIMIT: u64 = 1 << 20;
    let store = SnapshotStore::new(Arc::new(object_store::memory::InMemory::new()), "fuzz")
        .with_read_limits(ReadLimits {
            max_delta_size: LIMIT,
            max_inflation_ratio: 250,
            min_full_bound: LIMIT,
        });
    runtime().block_on(async {
        for codec in [Codec::Gzip, Codec::Zlib, Codec::Lzw, Codec::None] {
            for kind in [Kind::Full, Kind::Incr] {
                let s = store.new_snapshot(kind, 1, 2, codec, false);
                store
                    .put_bytes(&s, bytes::Bytes::copy_from_slice(data))
                    .await
                    .expect("an in-memory put");
                let bound = store.bound_of(&s, data.len() as u64).limit;
                let mut stream = store.get_decoded(&s).await.expect("an in-memory get");
                let mut passed = 0u64;
                use futures::StreamExt;
                while let Some(chunk) = stream.next().await {
                    match chunk {
                        Ok(b) => passed += b.len() as u64,
                        Err(_) => break,
                    }
                }
                assert!(passed <= bound, "{passed} bytes passed a bound of {bound}");
                if kind == Kind::Incr {
                    let _ = delta::read(&store, &s).await;
                }
            }
        }
    });
}

/// An age file opened with a fixed identity (neither the recipient's nor not): the header
/// check and the decrypting stream. The work is bounded: a header is read no further than
/// `MAX_HEADER_BYTES`, and age, handed it whole, parses it once.
pub fn age(data: &[u8]) {
    use std::str::FromStr;
    // A fixed key (the bytes 7..39): the seeds are encrypted to it, so mutations of them reach
    // the payload's chunks.
    const KEY: &str = "AGE-SECRET-KEY-1QUYQJZSTPSXSURCSZYFPX9Q4ZCT3SXG6RVWP68SLYQSJYGEYY5NQ23P5FC";
    let Ok(identity) = age::x25519::Identity::from_str(KEY) else {
        return;
    };
    let _ = encryption::check_header(data, std::slice::from_ref(&identity));
    let _ = encryption::looks_encrypted(data);
    let mut rest = data;
    if let Ok(header) = encryption::read_header(&mut rest) {
        assert!(header.len() <= encryption::MAX_HEADER_BYTES);
        let reads = match encryption::header_reads(data, std::slice::from_ref(&identity)) {
            Ok(n) | Err((n, _)) => n,
        };
        assert!(reads <= 1, "age parsed a header {reads} times");
    }
    let input = compression::once(bytes::Bytes::copy_from_slice(data));
    let _ = runtime()
        .block_on(async { compression::collect(encryption::decrypt(input, vec![identity])).await });
}

/// etcd-backup-restore's Secret in its JSON form (`<PROVIDER>_APPLICATION_CREDENTIALS_JSON`, a
/// `.json` in the directory, GCS's service account), read by `etcdbrctl`'s translation. The
/// first byte picks the provider.
pub fn ebr_secret(data: &[u8]) {
    let Some((&pick, json)) = data.split_first() else {
        return;
    };
    let dir = scratch();
    let file = write(&dir, "credentials.json", json).display().to_string();
    let (provider, var) = match pick % 4 {
        0 => ("S3", "AWS_APPLICATION_CREDENTIALS_JSON"),
        1 => ("OCS", "OPENSHIFT_APPLICATION_CREDENTIALS_JSON"),
        2 => ("ABS", "AZURE_APPLICATION_CREDENTIALS_JSON"),
        _ => ("GCS", "GOOGLE_APPLICATION_CREDENTIALS"),
    };
    let args: Vec<String> = [
        "snapshot",
        &format!("--storage-provider={provider}"),
        "--store-container=bucket",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let env = |k: &str| (k == var).then(|| file.clone());
    let _ = crate::etcdbrctl::translate(&args, &env);
}

/// An `etcdbrctl` command line, arguments separated by newlines, with no environment.
pub fn etcdbrctl_flags(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let args: Vec<String> = text.split('\n').map(str::to_string).collect();
    let env = |_: &str| None;
    let _ = crate::etcdbrctl::translate(&args, &env);
}

/// A `config.toml`, loaded through the same path as `--config` (defaults, the file, no
/// environment) and validated.
pub fn config(data: &[u8]) {
    let dir = scratch();
    let path = write(&dir, "config.toml", data);
    let env = std::collections::HashMap::<String, String>::new();
    let sources = crate::config::Sources {
        file: Some(&path),
        env: &env,
        overrides: vec![],
    };
    if let Ok((_, raw)) = crate::config::Config::load(&sources) {
        let _ = raw.to_redacted_toml();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every committed corpus and regression input of every target runs through its body: what
    /// the fuzzer found stays fixed without a nightly toolchain.
    #[test]
    fn committed_fuzz_inputs_end_in_an_error_or_a_result() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
        let mut ran = 0;
        for (name, body) in TARGETS {
            for dir in ["corpus", "regressions"] {
                let Ok(entries) = std::fs::read_dir(root.join(dir).join(name)) else {
                    continue;
                };
                for entry in entries {
                    let path = entry.unwrap().path();
                    let data = std::fs::read(&path).unwrap();
                    let run = std::panic::catch_unwind(|| body(&data));
                    assert!(run.is_ok(), "{name}: {} panicked", path.display());
                    ran += 1;
                }
            }
        }
        assert!(ran > 0, "no committed fuzz input under {}", root.display());
        let _ = std::fs::remove_dir_all(scratch());
    }

    /// Writes the seed corpora and runs each seed through its target's body. In CI they go to a
    /// temporary directory (the seeds must still build, and end in an error or a result); to
    /// refresh the committed ones, `FUZZ_SEEDS_OUT=fuzz/corpus cargo test --lib write_seeds`,
    /// then minimise them with `cargo fuzz cmin` (docs/fuzzing.md).
    #[test]
    fn write_seeds() {
        use crate::restore::bolt::{Bucket, NewFile};
        use crate::restore::member_dir::{self, Cluster, Member, Release};
        use std::str::FromStr;
        let temporary = tempfile::tempdir().unwrap();
        let root = std::env::var_os("FUZZ_SEEDS_OUT")
            .map(|d| Path::new(env!("CARGO_MANIFEST_DIR")).join(d))
            .unwrap_or_else(|| temporary.path().to_path_buf());
        let put = |target: &str, name: &str, data: &[u8]| {
            let dir = root.join(target);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join(name), data).unwrap();
        };
        put(
            "layout",
            "names",
            b"etcd/backup\nFull-00000000-00000010-1700000000.gz\nIncr-00000011-00000020-1700000100.gz\n\
              Incr-00000021-00000030-1700000200.zlib.age.final\nFull-00000000-00000030-1700000300\n",
        );
        let time = chrono::DateTime::from_timestamp(1_700_000_000, 123_000_000).unwrap();
        let kv = |k: &str, rev: i64| delta::KeyValue {
            key: k.as_bytes().to_vec(),
            value: b"value".to_vec(),
            create_revision: 2,
            mod_revision: rev,
            version: rev - 1,
            lease: 7,
        };
        let events = vec![
            delta::TimedEvent {
                event: delta::Event {
                    kind: delta::EventType::Put,
                    kv: Some(kv("a", 3)),
                    prev_kv: Some(kv("a", 2)),
                },
                time,
            },
            delta::TimedEvent {
                event: delta::Event {
                    kind: delta::EventType::Delete,
                    kv: Some(kv("b", 4)),
                    prev_kv: None,
                },
                time,
            },
        ];
        let payload = delta::encode(&events).unwrap();
        put("delta", "json", &payload[..payload.len() - 32]);
        put("delta", "hashed", &payload);
        for (codec, name) in [(Codec::Gzip, "gzip"), (Codec::Zlib, "zlib")] {
            let level = compression::Level::default();
            put(
                "store_decode",
                name,
                &delta::encode_compressed(&events, codec, level).unwrap(),
            );
        }
        // etcd-warden's sized gzip members (two small ones, so the parallel inflate's cutting
        // and checks are reached), then the same followed by a plain member (the fallback).
        let sized = |data: &[u8]| {
            let level = compression::Level::default();
            let input = compression::once(bytes::Bytes::copy_from_slice(data));
            runtime()
                .block_on(async {
                    compression::collect(Codec::Gzip.encode(input, 1, level).unwrap()).await
                })
                .unwrap()
        };
        let members = [sized(&payload[..payload.len() / 2]), sized(&payload)].concat();
        put("store_decode", "gzip_members", &members);
        let plain =
            delta::encode_compressed(&events, Codec::Gzip, compression::Level::default()).unwrap();
        put(
            "store_decode",
            "gzip_members_then_plain",
            &[&members[..], &plain].concat(),
        );
        let identity = age::x25519::Identity::from_str(
            "AGE-SECRET-KEY-1QUYQJZSTPSXSURCSZYFPX9Q4ZCT3SXG6RVWP68SLYQSJYGEYY5NQ23P5FC",
        )
        .unwrap();
        let sealed = encryption::encrypt_bytes(&payload, &[identity.to_public()]).unwrap();
        put("age", "sealed", &sealed);
        // Headers beyond the bounds of `encryption::read_header`: more stanzas than it takes (age
        // alone parsed this shape quadratically), and a line longer than it takes.
        let mac = [&b"--- "[..], &[b'A'; 43], b"\n", &[0u8; 32]].concat();
        let many = [encryption::AGE_MAGIC, &b"-> a\n\n".repeat(600), &mac].concat();
        put("age", "quadratic", &many);
        let long = [
            encryption::AGE_MAGIC,
            b"-> ",
            &[b'a'; 8 << 10],
            b"\n\n",
            &mac,
        ]
        .concat();
        put("age", "long_line", &long);
        put("store_decode", "sealed", &sealed);
        let member = |id: u64, name: &str| Member {
            id,
            name: name.into(),
            peer_urls: vec![format!("https://{name}:2380")],
        };
        let cluster = Cluster {
            id: 0x1234,
            members: vec![member(1, "a"), member(2, "b"), member(3, "c")],
            local: 1,
        };
        put("wal", "v34", &member_dir::wal_bytes(&cluster, Release::V34));
        put("wal", "v35", &member_dir::wal_bytes(&cluster, Release::V35));
        put("wal", "snap", &member_dir::snap_bytes(&cluster));
        let dir = scratch();
        let path = dir.join("seed.db");
        let mut w = NewFile::create(&path, 512).unwrap();
        let mut key = w.tree();
        for rev in 1..=12i64 {
            let k = format!("k{rev}");
            key.push(
                &direct::revision_key(rev, 0, false),
                &direct::encode_kv(k.as_bytes(), rev, rev, 1, &[b'v'; 40]),
            )
            .unwrap();
        }
        let key = key.finish().unwrap();
        let mut meta = w.tree();
        meta.push(b"consistent_index", &[0; 8]).unwrap();
        meta.push(b"finishedCompactRev", &direct::revision_key(2, 0, false))
            .unwrap();
        let meta = meta.finish().unwrap();
        w.finish(
            &[Bucket::paged(b"key", key), Bucket::paged(b"meta", meta)],
            3,
        )
        .unwrap();
        let db = std::fs::read(&path).unwrap();
        Reader::open(&path, db.len() as u64)
            .unwrap()
            .check()
            .unwrap();
        put("bolt", "small", &db);
        // The issue's crafted snapshot, small: 16 leaves each claiming as overflow every page to
        // the end of the file (read whole per leaf before the walks marked overflow seen).
        put(
            "bolt",
            "overflow-leaves",
            &crate::restore::bolt::crafted::overflow_leaves(512, 16),
        );
        let mut torn = db.clone();
        torn[40] ^= 1;
        put("bolt", "torn-meta", &torn);
        put("patch", "small", &db);
        for (n, json) in [
            (
                0u8,
                r#"{"accessKeyID":"AKIA","secretAccessKey":"s","region":"eu-west-1","endpoint":"http://127.0.0.1:9000","s3ForcePathStyle":"true"}"#,
            ),
            (
                1,
                r#"{"accessKeyID":"a","secretAccessKey":"s","region":"r","endpoint":"https://ocs","disableSSL":false,"insecureSkipVerify":true}"#,
            ),
            (
                2,
                r#"{"storageAccount":"acct","storageKey":"a2V5","domain":"blob.core.windows.net","emulatorEnabled":"false"}"#,
            ),
            (3, r#"{"type":"service_account","project_id":"p"}"#),
        ] {
            let mut data = vec![n];
            data.extend_from_slice(json.as_bytes());
            put("ebr_secret", &format!("p{n}"), &data);
        }
        put(
            "etcdbrctl_flags",
            "snapshot",
            b"snapshot\n--storage-provider=S3\n--store-container=b\n--store-prefix=etcd\n\
              --schedule=*/5 * * * *\n--delta-snapshot-period=20s\n--compress-snapshots\n\
              --compression-policy=zlib\n--max-backups=7\n--garbage-collection-policy=LimitBased",
        );
        put(
            "etcdbrctl_flags",
            "restore",
            b"restore\n--storage-provider=Local\n--data-dir=/d\n--initial-cluster=a=https://a:2380\n\
              --name=a\n-e=https://a:2379\n--embedded-etcd-quota-bytes=8Gi\n--max-call-send-message-size=1000",
        );
        put(
            "config",
            "example",
            &std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("config.example.toml"))
                .unwrap(),
        );
        put(
            "config",
            "small",
            b"[store]\nurl = \"s3://b/p\"\n[snapshot]\nschedule = \"*/5 * * * *\"\ncompression = \"zlib\"\n",
        );
        let _ = std::fs::remove_dir_all(dir);
        // Every seed ends in an error or a result in its target's body.
        for (name, body) in TARGETS {
            let entries = std::fs::read_dir(root.join(name))
                .unwrap_or_else(|e| panic!("{name}: no seeds written: {e}"));
            for entry in entries {
                let path = entry.unwrap().path();
                let data = std::fs::read(&path).unwrap();
                let run = std::panic::catch_unwind(|| body(&data));
                assert!(run.is_ok(), "{name}: seed {} panicked", path.display());
            }
        }
        let _ = std::fs::remove_dir_all(scratch());
    }
}
