//! Store conformance: one set of checks run against every backend (in-memory, local filesystem,
//! and a real S3 server), through the same `SnapshotStore` the sidecar uses.

use crate::support;

use etcd_warden::owner::handoff::{Claim, Created, HandOffObjects};

use std::io;
use std::sync::Arc;

use bytes::Bytes;
use chrono::{TimeZone, Utc};
use etcd_warden::config::{Secret, StoreConfig};
use etcd_warden::store::compression::{ByteStream, collect};
use etcd_warden::store::{Codec, Kind, Snapshot, SnapshotStore, StoreError, StoreLocation};
use futures::StreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use support::s3::{self, S3Server};

fn store_config(url: &str) -> StoreConfig {
    StoreConfig::at(StoreLocation::parse(url).unwrap())
}

fn snap(store: &SnapshotStore, kind: Kind, start: i64, last: i64, secs: i64) -> Snapshot {
    Snapshot::new(
        store.prefix(),
        kind,
        start,
        last,
        Utc.timestamp_opt(secs, 0).unwrap(),
        Codec::Gzip,
        false,
    )
}

/// A payload of `len` bytes that is not trivially compressible.
fn payload(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn chunked(data: &[u8], size: usize) -> ByteStream {
    let v: Vec<io::Result<Bytes>> = data
        .chunks(size)
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect();
    futures::stream::iter(v).boxed()
}

/// [`checks`] on the store `cfg` builds, without the process's provider variables.
async fn conformance(cfg: &StoreConfig) {
    let env = std::collections::HashMap::<String, String>::new();
    let raw = etcd_warden::store::build_with_env(cfg, &env, None).unwrap();
    checks(SnapshotStore::new(raw.clone(), cfg.location.prefix()), raw).await;
}

/// The checks every backend must pass. `raw` is the backend the store wraps, for planting
/// objects that are not snapshots.
async fn checks(store: SnapshotStore, raw: Arc<dyn ObjectStore>) {
    assert!(
        store.list().await.unwrap().is_empty(),
        "a new store is empty"
    );
    let chain = store.latest_chain().await.unwrap();
    assert!(chain.full_snapshot.is_none() && chain.delta_snapshots.is_empty());

    // A multipart upload of several parts reads back byte for byte.
    let big = payload((8 << 20) * 2 + 12345);
    let full1 = snap(&store, Kind::Full, 0, 100, 1_700_000_000);
    let n = store
        .put_stream(&full1, chunked(&big, 1 << 20))
        .await
        .unwrap();
    assert_eq!(n, big.len() as u64);
    let back = collect(store.get_stream(&full1).await.unwrap())
        .await
        .unwrap();
    assert!(back == big, "multipart payload differs");

    // Small payloads in one request.
    let d1 = snap(&store, Kind::Incr, 101, 150, 1_700_000_100);
    let d2 = snap(&store, Kind::Incr, 151, 170, 1_700_000_200);
    store
        .put_bytes(&d1, Bytes::from_static(b"d1"))
        .await
        .unwrap();
    store
        .put_bytes(&d2, Bytes::from_static(b"d2"))
        .await
        .unwrap();
    let full2 = snap(&store, Kind::Full, 0, 170, 1_700_000_300);
    store.put_stream(&full2, chunked(b"f2", 1)).await.unwrap();
    let d3 = snap(&store, Kind::Incr, 171, 180, 1_700_000_400);
    store
        .put_bytes(&d3, Bytes::from_static(b"d3"))
        .await
        .unwrap();

    // Objects that are not snapshots are not listed as snapshots: other tools' files, chunk
    // objects, and anything outside the layout directory. The listing for operators names
    // those in the layout directory.
    let v2 = etcd_warden::store::layout::version_prefix(store.prefix());
    for key in [
        format!("{v2}README"),
        format!("{v2}Full-00000000-00000200-1700000000.gz/0000001"),
        format!("{v2}Full-1-2-3"),
        "elsewhere/Full-00000000-00000001-1700000000.gz".to_string(),
    ] {
        raw.put(&Path::from(key), PutPayload::from_static(b"x"))
            .await
            .unwrap();
    }

    // Sorted by last revision, then creation time (full2 and d2 share revision 170).
    let list = store.list().await.unwrap();
    let names: Vec<&str> = list.iter().map(|s| s.snap_name.as_str()).collect();
    assert_eq!(
        names,
        vec![
            full1.snap_name.as_str(),
            d1.snap_name.as_str(),
            d2.snap_name.as_str(),
            full2.snap_name.as_str(),
            d3.snap_name.as_str(),
        ]
    );
    let listing = store.listing().await.unwrap();
    assert_eq!(listing.snapshots(), list);
    assert_eq!(
        listing.unrecognised_names(),
        [
            "Full-00000000-00000200-1700000000.gz/0000001",
            "Full-1-2-3",
            "README"
        ]
    );
    assert_eq!(listing.unrecognised[2].key, format!("{v2}README"));
    assert_eq!(listing.unrecognised[2].size, 1);
    let chain = store.latest_chain().await.unwrap();
    assert_eq!(chain.full_snapshot.as_ref(), Some(&full2));
    assert_eq!(chain.delta_snapshots, vec![d3.clone()]);

    // A failing payload aborts the upload: nothing appears, even after parts were sent.
    let failing = snap(&store, Kind::Full, 0, 999, 1_700_000_500);
    let head = payload(9 << 20);
    let stream = chunked(&head, 1 << 20)
        .chain(futures::stream::once(async {
            Err(io::Error::new(io::ErrorKind::InvalidData, "hash mismatch"))
        }))
        .boxed();
    let e = store.put_stream(&failing, stream).await.unwrap_err();
    assert!(matches!(e, StoreError::Payload(_)), "{e:?}");
    let after = store.list().await.unwrap();
    assert_eq!(after, list, "a failed upload became visible");
    assert!(store.get_stream(&failing).await.is_err());

    // Create-if-absent, as the hand-off's intent and claims use it: the second writer of a key
    // finds the first one's object and nothing overwrites it. Every backend here has
    // conditional writes; a store without them would answer `Unconditional`.
    let objects = HandOffObjects::new(store.clone());
    let claim = |member: &str| Claim {
        epoch: 0,
        member_id: member.into(),
        claimed_at: chrono::Utc::now(),
    };
    assert_eq!(
        objects.create_claim(&claim("a")).await.unwrap(),
        Created::Created
    );
    assert_eq!(
        objects.create_claim(&claim("b")).await.unwrap(),
        Created::Exists
    );
    let claims = objects.claims().await.unwrap();
    assert_eq!(claims.len(), 1);
    assert_eq!(claims[0].member_id, "a", "the first claim stands");

    // Delete.
    store.delete(&d1).await.unwrap();
    store.delete(&full1).await.unwrap();
    let list = store.list().await.unwrap();
    assert_eq!(list, vec![d2, full2, d3]);
    assert!(store.get_stream(&full1).await.is_err());
}

/// The names of the snapshots `store` lists, oldest first.
async fn names(store: &SnapshotStore) -> Vec<String> {
    store
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.snap_name)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_in_memory() {
    let cfg = store_config("memory://pre/fix");
    conformance(&cfg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_local_filesystem() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("backups");
    let cfg = store_config(&format!("file://{}", root.display()));
    conformance(&cfg).await;
    // The layout on disk is the reference's (<dir>/v2/<name>), and the aborted upload left no
    // temporary file behind.
    let mut names: Vec<String> = std::fs::read_dir(root.join("v2"))
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().unwrap().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        vec![
            "Full-00000000-00000170-1700000300.gz",
            "Full-1-2-3",
            "Incr-00000151-00000170-1700000200.gz",
            "Incr-00000171-00000180-1700000400.gz",
            "README",
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_s3() {
    let server = S3Server::start(&["etcd-backups"]);
    let cfg = server.store_config("etcd-backups", "shoot/etcd-main");
    conformance(&cfg).await;
}

/// An S3 store's uploads of known length go in one streamed `PUT`: it stores exactly the
/// declared length or nothing (a short body, a long one, an error item in its last chunk's
/// place), where a multipart upload stores whatever the stream held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_single_put_stores_exactly_the_declared_length_or_nothing() {
    let server = S3Server::start(&["etcd-backups"]);
    let cfg = server.store_config("etcd-backups", "one-put");
    let store = SnapshotStore::from_config(&cfg).unwrap();
    let data = payload(3 << 20);
    let len = data.len() as u64;

    // A full snapshot at revision `rev`, named distinctly.
    let at = |rev: i64| snap(&store, Kind::Full, 0, rev, 1_700_000_000 + rev);
    let ok = at(1);
    let stored = store
        .put_stream_sized(&ok, chunked(&data, 64 << 10), len)
        .await
        .unwrap();
    assert_eq!(stored, len);
    let back = collect(store.get_stream(&ok).await.unwrap());
    assert_eq!(back.await.unwrap(), data);

    // Bodies that leave nothing: (revision, body, length declared, the payload error).
    let mut failing: Vec<io::Result<Bytes>> = data[..len as usize - 1000]
        .chunks(64 << 10)
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect();
    failing.push(Err(io::Error::new(io::ErrorKind::InvalidData, "bad hash")));
    type Says = dyn Fn(&str) -> bool;
    let cases: [(i64, ByteStream, u64, &Says); 3] = [
        (2, chunked(&data[..1 << 20], 64 << 10), len, &|m| {
            m.contains("shorter")
        }),
        (3, chunked(&data, 64 << 10), len - 1, &|m| {
            m.contains("longer")
        }),
        (4, futures::stream::iter(failing).boxed(), len, &|m| {
            m == "bad hash"
        }),
    ];
    for (rev, body, declared, says) in cases {
        let e = store
            .put_stream_sized(&at(rev), body, declared)
            .await
            .unwrap_err();
        assert!(
            matches!(&e, StoreError::Payload(p) if says(&p.to_string())),
            "{e:?}"
        );
    }
    let short = at(2);

    let names: Vec<String> = names(&store).await;
    assert_eq!(names, vec![ok.snap_name.clone()]);

    // The same short body through a multipart upload is stored as it is: the single PUT is
    // what enforces the length.
    let multipart = store.clone().with_single_put(None);
    multipart
        .put_stream_sized(&short, chunked(&data[..1 << 20], 64 << 10), len)
        .await
        .unwrap();
    assert_eq!(store.list().await.unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_credentials_from_files_and_environment() {
    let server = S3Server::start(&["bkt"]);
    let dir = tempfile::tempdir().unwrap();
    let id = dir.path().join("id");
    let secret = dir.path().join("secret");
    std::fs::write(&id, format!("{}\n", s3::ACCESS_KEY)).unwrap();
    std::fs::write(&secret, "wrong").unwrap();
    // Endpoint and region from the (SOURCE_-prefixed) environment, credentials from files.
    let env: std::collections::HashMap<String, String> = [
        ("SOURCE_AWS_ENDPOINT", server.endpoint()),
        ("AWS_ENDPOINT", "http://127.0.0.1:1".to_string()),
        ("AWS_REGION", "us-east-1".to_string()),
        ("AWS_ALLOW_HTTP", "true".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let mut cfg = store_config("s3://bkt/p");
    cfg.access_key_id = Some(Secret::File(id));
    cfg.secret_access_key = Some(Secret::File(secret.clone()));
    let raw = etcd_warden::store::build_with_env(&cfg, &env, Some("SOURCE_")).unwrap();
    let store = SnapshotStore::new(raw, "p");
    assert!(store.list().await.is_err(), "a wrong secret was accepted");
    // Rotating the file is picked up without rebuilding the store.
    std::fs::write(&secret, s3::SECRET_KEY).unwrap();
    let s = snap(&store, Kind::Full, 0, 1, 1_700_000_000);
    store
        .put_bytes(&s, Bytes::from_static(b"ok"))
        .await
        .unwrap();
    assert_eq!(store.list().await.unwrap(), vec![s]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_azure_emulator() {
    let server = support::azurite::Azurite::start();
    server.create_container("etcd-backups").await;
    let mut cfg = store_config("az://etcd-backups/shoot/etcd-main");
    cfg.use_emulator = true;
    cfg.endpoint = Some(server.endpoint());
    conformance(&cfg).await;
}

/// A file store in `dir` with a full snapshot and a delta that verify, and the store's URL.
async fn file_store_with_a_chain(dir: &std::path::Path) -> (SnapshotStore, String) {
    let url = format!("file://{}", dir.display());
    let store = SnapshotStore::from_config(&store_config(&url)).unwrap();
    support::stored::put_full(&store, 10, 1_700_000_000, 50_000, Codec::Gzip, false).await;
    support::stored::put_delta(&store, 11, 12, 1_700_000_100).await;
    (store, url)
}

fn warden_on(args: &[&str], url: &str) -> std::process::Output {
    support::warden::command()
        .args(args)
        .args(["--store", url])
        .output()
        .unwrap()
}

/// Objects under `v2/` whose names do not parse are named by `ls` (text and JSON) and fail
/// `verify`; the snapshots around them are listed and verified as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ls_and_verify_name_objects_that_are_not_snapshots() {
    let dir = tempfile::tempdir().unwrap();
    let (store, url) = file_store_with_a_chain(dir.path()).await;
    let snapshots: Vec<String> = names(&store).await;
    let bad = ["Full-xyz", "Full-00000000-0000001x-1700000000.gz"];
    for name in bad {
        std::fs::write(dir.path().join("v2").join(name), b"x").unwrap();
    }
    // Healthy first: verify passes on the snapshots alone.
    let (clean_dir, clean_url) = {
        let d = tempfile::tempdir().unwrap();
        let (_, u) = file_store_with_a_chain(d.path()).await;
        (d, u)
    };
    let out = warden_on(&["verify"], &clean_url);
    assert!(out.status.success(), "{out:?}");
    drop(clean_dir);

    let out = warden_on(&["verify"], &url);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    for name in bad {
        assert!(
            stdout.contains(&format!("FAIL  {name}: not a snapshot name")),
            "{stdout}"
        );
        assert!(stderr.contains(name), "{stderr}");
    }
    for name in &snapshots {
        assert!(stdout.contains(&format!("ok    {name}")), "{stdout}");
    }
    let last = stderr.trim().lines().last().unwrap();
    assert!(
        last.starts_with("etcd-warden: 2 object(s) under v2/ are not snapshots"),
        "{stderr}"
    );

    let out = warden_on(&["ls"], &url);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("UNRECOGNISED: 2 object(s)"), "{stdout}");
    assert!(stdout.contains("?    Full-xyz  (expected 4"), "{stdout}");
    assert!(
        stdout.contains("?    Full-00000000-0000001x-1700000000.gz  (last revision"),
        "{stdout}"
    );

    let out = warden_on(&["ls", "--json"], &url);
    assert!(out.status.success(), "{out:?}");
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let shown = shown.as_array().unwrap();
    let kinds: Vec<&str> = shown.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["Unrecognised", "Unrecognised", "Full", "Incr"]);
    let mut unrecognised: Vec<&str> = shown[..2]
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    unrecognised.sort();
    let mut want = bad.to_vec();
    want.sort();
    assert_eq!(unrecognised, want);
    assert_eq!(
        shown[0]["key"],
        format!("v2/{}", shown[0]["name"].as_str().unwrap())
    );
    assert!(shown[0]["reason"].as_str().is_some_and(|r| !r.is_empty()));
    // The newest snapshot stays last, as scripts read it.
    assert_eq!(shown[3]["snapName"], snapshots[1]);
}

/// A delta missing after the newest full snapshot fails `verify` naming the revisions and the
/// snapshots around them; a gap before the newest full snapshot does not (no restore reads it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_names_a_revision_gap_in_the_latest_chain() {
    let dir = tempfile::tempdir().unwrap();
    let (store, url) = file_store_with_a_chain(dir.path()).await;
    // Delta 13-14 is lost.
    let after_gap = support::stored::put_delta(&store, 15, 20, 1_700_000_200).await;
    let out = warden_on(&["verify"], &url);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    let gap = format!(
        "revisions 13 to 14 are in no snapshot (Incr-00000011-00000012-1700000100.gz ends at 12, \
         the next delta {} starts at 15)",
        after_gap.snap_name
    );
    assert!(
        stdout.contains(&format!("FAIL  revision gap in the latest chain: {gap}")),
        "{stdout}"
    );
    assert!(stderr.contains(&gap), "{stderr}");

    // A newer full snapshot starts a chain without the gap.
    support::stored::put_full(&store, 20, 1_700_000_300, 50_000, Codec::Gzip, false).await;
    let out = warden_on(&["verify"], &url);
    assert!(out.status.success(), "{out:?}");
}

/// A file in a `file://` store whose name is no object key (not UTF-8; a newline in it) is
/// reported as unrecognised, escaped onto one line, by the listing, `ls` and `verify`; the
/// snapshots beside it are still listed, verified and retained. object_store's own listing
/// ends at the first such name with an error, which stopped all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_that_are_no_object_keys_stop_neither_listing_nor_verify_nor_retention() {
    use std::os::unix::ffi::OsStrExt;

    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let store = SnapshotStore::from_config(&store_config(&url)).unwrap();
    let fulls = three_good_fulls(&store).await;
    let v2 = dir.path().join("v2");
    std::fs::write(v2.join(std::ffi::OsStr::from_bytes(b"Full-\xff")), b"x").unwrap();
    std::fs::write(
        v2.join("Full-00000000-00000099-1700000000.gz\nFull-forged"),
        b"y",
    )
    .unwrap();

    // The hand-off's directory too (`ls` and `verify` read it for the final snapshot).
    let fence = dir.path().join("etcd-warden/fence");
    std::fs::create_dir_all(&fence).unwrap();
    std::fs::write(fence.join(std::ffi::OsStr::from_bytes(b"\xfe.json")), b"{}").unwrap();

    let listing = store.listing().await.unwrap();
    assert_eq!(listing.snapshots(), fulls);
    let mut names = listing.unrecognised_names();
    names.sort();
    assert_eq!(
        names,
        vec![
            "Full-00000000-00000099-1700000000.gz\\nFull-forged",
            "Full-\\xff"
        ]
    );
    assert!(listing.unrecognised.iter().all(|u| u.size == 1));

    // The command line: `ls` lists the three and names the two; `verify` verifies the three
    // and fails naming the two, as for any name that does not parse.
    let ls = support::warden::command()
        .args(["ls", "--store", &url])
        .output()
        .unwrap();
    let said = support::cli::printed(&ls);
    assert!(ls.status.success(), "{said}");
    for s in &fulls {
        assert!(said.contains(&s.snap_name), "{said}");
    }
    assert!(said.contains("Full-\\xff"), "{said}");
    assert!(
        !said.lines().any(|l| l.starts_with("Full-forged")),
        "a newline in a name printed a line of its own: {said}"
    );
    let verify = support::warden::command()
        .args(["verify", "--store", &url])
        .output()
        .unwrap();
    let said = support::cli::printed(&verify);
    assert!(!verify.status.success(), "{said}");
    assert_eq!(said.matches("ok    Full-").count(), 3, "{said}");
    assert!(said.contains("FAIL  Full-\\xff"), "{said}");
    assert!(said.contains("2 object(s)"), "{said}");

    // Retention deletes what its policy says and leaves the two alone.
    let listing = retention_keeps_the_newest_of(&store, &fulls).await;
    assert_eq!(listing.unrecognised.len(), 2);
}

/// An S3 bucket holding keys that are no object keys (a newline, a carriage return, another
/// control character) beside good snapshots: the listing, `ls`, `verify`, the restore's chain
/// and retention still see every snapshot and report each such key as unrecognised, escaped
/// onto one line. object_store fails a whole listing page at the first such key, which
/// stopped all of them (real s3s-fs; the variants it cannot hold, `a//b`, `..`, are in
/// `store::paged`'s tests).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_keys_that_are_no_object_keys_stop_neither_listing_nor_verify_nor_retention() {
    let s3 = S3Server::start(&["bkt"]);
    let store = SnapshotStore::from_config(&s3.store_config("bkt", "p")).unwrap();
    let fulls = three_good_fulls(&store).await;
    // s3s-fs keeps a bucket's objects as files: these are keys object_store cannot parse.
    let v2 = s3.root.path().join("bkt/p/v2");
    for name in [
        "Full-00000000-00000099-1700000000.gz\nFull-forged",
        "Full-00000000-00000098-1700000000.gz\r",
        "bell\u{7}",
    ] {
        std::fs::write(v2.join(name), b"y").unwrap();
    }
    let fence = s3.root.path().join("bkt/p/etcd-warden/fence");
    std::fs::create_dir_all(&fence).unwrap();
    std::fs::write(fence.join("x\n.json"), b"{}").unwrap();

    let listing = store.listing().await.unwrap();
    assert_eq!(listing.snapshots(), fulls);
    let mut names = listing.unrecognised_names();
    names.sort();
    // The carriage return arrives as a newline: XML reads every line end as one.
    assert_eq!(
        names,
        vec![
            "Full-00000000-00000098-1700000000.gz\\n",
            "Full-00000000-00000099-1700000000.gz\\nFull-forged",
            "bell\\x07",
        ]
    );
    // What a restore starts from.
    assert_eq!(
        store.latest_chain().await.unwrap().full_snapshot,
        Some(fulls[2].clone())
    );

    let url = "s3://bkt/p";
    let ls = support::warden::command()
        .args(["ls", "--store", url])
        .envs(s3.env("store"))
        .output()
        .unwrap();
    let said = support::cli::printed(&ls);
    assert!(ls.status.success(), "{said}");
    for s in &fulls {
        assert!(said.contains(&s.snap_name), "{said}");
    }
    assert!(said.contains("bell\\x07"), "{said}");
    assert!(
        !said.lines().any(|l| l.starts_with("Full-forged")),
        "a newline in a name printed a line of its own: {said}"
    );
    let verify = support::warden::command()
        .args(["verify", "--store", url])
        .envs(s3.env("store"))
        .output()
        .unwrap();
    let said = support::cli::printed(&verify);
    assert!(!verify.status.success(), "{said}");
    assert_eq!(said.matches("ok    Full-").count(), 3, "{said}");
    assert!(said.contains("3 object(s)"), "{said}");

    let listing = retention_keeps_the_newest_of(&store, &fulls).await;
    assert_eq!(listing.unrecognised.len(), 3);
}

/// Three valid gzip full snapshots (revisions 10, 20, 30, a second apart), oldest first.
async fn three_good_fulls(store: &SnapshotStore) -> Vec<Snapshot> {
    let now = Utc::now().timestamp();
    let mut fulls = Vec::new();
    for (i, last) in [10, 20, 30].into_iter().enumerate() {
        let s = snap(store, Kind::Full, 0, last, now - 100 + i as i64);
        let mut payload = self::payload(4096);
        let hash = sha2::Digest::finalize(sha2::Digest::chain_update(
            <sha2::Sha256 as sha2::Digest>::new(),
            &payload,
        ));
        payload.extend_from_slice(&hash);
        let gz = collect(
            Codec::Gzip
                .encode(chunked(&payload, 4096), 1, Default::default())
                .unwrap(),
        )
        .await
        .unwrap();
        store.put_bytes(&s, Bytes::from(gz)).await.unwrap();
        fulls.push(s);
    }
    fulls
}

/// Retention keeping one full snapshot deletes the two older of `fulls` and nothing else;
/// the listing after it.
async fn retention_keeps_the_newest_of(
    store: &SnapshotStore,
    fulls: &[Snapshot],
) -> etcd_warden::store::Listing {
    use etcd_warden::config::GcPolicy;
    use etcd_warden::store::gc::{self, Retention};
    let retention = Retention {
        policy: GcPolicy::LimitBased { max_backups: 1 },
        delta_retention: std::time::Duration::ZERO,
    };
    let report = gc::run(store, Utc::now(), retention).await.unwrap();
    assert_eq!(report.deleted, fulls[..2].to_vec());
    let listing = store.listing().await.unwrap();
    assert_eq!(listing.snapshots(), fulls[2..].to_vec());
    listing
}
