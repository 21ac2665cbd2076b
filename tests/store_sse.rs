//! S3 server-side encryption (`store.server_side_encryption`): every object etcd-warden
//! writes carries it, through each way it writes (one PUT, a multipart upload, the copy Job's
//! streamed copy and its server-side copy), and with SSE-C every read carries the key too.
//! S3 is moto's server on loopback, which records SSE-KMS (HEAD answers with the algorithm and
//! the key id) but encrypts nothing, accepts any KMS key id, and does not enforce SSE-C at all;
//! so SSE-C is checked on the wire, by a proxy in front of moto that records every request's
//! headers. Not checked: a real KMS's key policy, a real S3's refusal of a read without the
//! customer key.

use std::collections::HashMap;

use base64::Engine as _;
use bytes::Bytes;
use chrono::Utc;
use etcd_warden::copy;
use etcd_warden::snapshot::verify::verify;
use etcd_warden::store::{Codec, Kind, Snapshot, SnapshotStore};
use md5::Digest as _;

use crate::copy::{options, stores_from};
use crate::support::moto::{ACCOUNT as MOTO, MotoServer};
use crate::support::recorder::Recorder;
use crate::support::stored::{db_payload, put_delta, put_full};

fn with(mut keys: Vec<(String, String)>, more: &[(&str, &str)]) -> Vec<(String, String)> {
    keys.extend(more.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    keys
}

/// A full snapshot through a multipart upload (as the sidecar streams one), a delta in one PUT
/// and a final: the three ways a sidecar writes.
async fn write_history(store: &SnapshotStore) -> Vec<Snapshot> {
    let now = Utc::now().timestamp();
    let streamed = Snapshot::new(
        store.prefix(),
        Kind::Full,
        0,
        10,
        chrono::TimeZone::timestamp_opt(&Utc, now - 3600, 0).unwrap(),
        Codec::None,
        false,
    );
    let payload = Bytes::from(db_payload(6 << 20, 10));
    store
        .put_stream(
            &streamed,
            Box::pin(futures::stream::iter(
                payload
                    .chunks(1 << 20)
                    .map(|c| Ok(Bytes::copy_from_slice(c)))
                    .collect::<Vec<_>>(),
            )),
        )
        .await
        .unwrap();
    vec![
        streamed,
        put_delta(store, 11, 12, now - 1800).await,
        put_full(store, 20, now, 200_000, Codec::Gzip, true).await,
    ]
}

/// The object keys in a bucket.
async fn keys_in(moto: &MotoServer, bucket: &str) -> Vec<String> {
    let listing = moto
        .request(reqwest::Method::GET, &format!("/{bucket}?list-type=2"))
        .await
        .text()
        .await
        .unwrap();
    listing
        .split("<Key>")
        .skip(1)
        .filter_map(|s| s.split("</Key>").next())
        .map(str::to_string)
        .collect()
}

/// SSE-KMS with one key on the sidecar's bucket and another on the copy's: HEAD shows each
/// object under its bucket's key, whichever way it was written or copied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_kms_is_on_every_object_written_and_copied() {
    let moto = MotoServer::with_buckets(&["backups", "copies"]).await;
    let ep = moto.endpoint();
    let primary = [
        ("source_store.server_side_encryption", "aws:kms"),
        ("source_store.sse_kms_key_id", "alias/etcd-primary"),
    ];
    let streamed = stores_from(with(
        [
            MOTO.config_overrides("source_store", &ep, "backups", "etcd"),
            MOTO.config_overrides("store", &ep, "copies", "etcd"),
        ]
        .concat(),
        &[
            primary[0],
            primary[1],
            ("store.server_side_encryption", "aws:kms"),
            ("store.sse_kms_key_id", "alias/etcd-copies"),
        ],
    ));
    assert!(!streamed.server_side);
    let written = write_history(&streamed.source).await;
    let report = copy::run(&streamed, &options()).await.unwrap();
    assert_eq!(report.copied, written.len(), "{report:?}");
    // Within one bucket the copy Job copies server side (CopyObject).
    let in_bucket = stores_from(with(
        [
            MOTO.config_overrides("source_store", &ep, "backups", "etcd"),
            MOTO.config_overrides("store", &ep, "backups", "etcd-again"),
        ]
        .concat(),
        &[
            primary[0],
            primary[1],
            ("store.server_side_encryption", "aws:kms"),
            ("store.sse_kms_key_id", "alias/etcd-primary"),
        ],
    ));
    assert!(in_bucket.server_side);
    copy::run(&in_bucket, &options()).await.unwrap();

    for (bucket, key_id, want) in [
        ("backups", "alias/etcd-primary", 2 * written.len()),
        ("copies", "alias/etcd-copies", written.len()),
    ] {
        let keys = keys_in(&moto, bucket).await;
        assert_eq!(keys.len(), want, "{bucket}: {keys:?}");
        for key in keys {
            let head = moto
                .request(reqwest::Method::HEAD, &format!("/{bucket}/{key}"))
                .await;
            let header = |n: &str| {
                head.headers()
                    .get(n)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string)
            };
            assert_eq!(
                (
                    header("x-amz-server-side-encryption").as_deref(),
                    header("x-amz-server-side-encryption-aws-kms-key-id").as_deref()
                ),
                (Some("aws:kms"), Some(key_id)),
                "{bucket}/{key}"
            );
        }
    }
}

/// SSE-C with one key on the sidecar's bucket and another on the copy's: every request that
/// writes or reads an object carries its bucket's key (the MD5 S3 checks it by), a server-side
/// copy carries the source's key as the copy source's, and every snapshot reads back whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_c_sends_each_buckets_key_with_every_object_read_and_write() {
    let moto = MotoServer::with_buckets(&["backups", "copies"]).await;
    let proxy = Recorder::start(&moto.endpoint(), None).await;
    let ep = proxy.endpoint();
    let dir = tempfile::tempdir().unwrap();
    let key_file = |name: &str, byte: u8| {
        let p = dir.path().join(name);
        std::fs::write(&p, [byte; 32]).unwrap();
        p.display().to_string()
    };
    let (k1, k2) = (key_file("primary", 1), key_file("copies", 2));
    let md5_of =
        |byte: u8| base64::engine::general_purpose::STANDARD.encode(md5::Md5::digest([byte; 32]));
    let streamed = stores_from(with(
        [
            MOTO.config_overrides("source_store", &ep, "backups", "etcd"),
            MOTO.config_overrides("store", &ep, "copies", "etcd"),
        ]
        .concat(),
        &[
            ("source_store.server_side_encryption", "sse-c"),
            ("source_store.sse_customer_key_file", &k1),
            ("store.server_side_encryption", "sse-c"),
            ("store.sse_customer_key_file", &k2),
        ],
    ));
    let written = write_history(&streamed.source).await;
    copy::run(&streamed, &options()).await.unwrap();
    let in_bucket = stores_from(with(
        [
            MOTO.config_overrides("source_store", &ep, "backups", "etcd"),
            MOTO.config_overrides("store", &ep, "backups", "etcd-again"),
        ]
        .concat(),
        &[
            ("source_store.server_side_encryption", "sse-c"),
            ("source_store.sse_customer_key_file", &k1),
            ("store.server_side_encryption", "sse-c"),
            ("store.sse_customer_key_file", &k1),
        ],
    ));
    assert!(in_bucket.server_side);
    copy::run(&in_bucket, &options()).await.unwrap();
    for store in [&streamed.dest, &in_bucket.dest] {
        let listed = store.list().await.unwrap();
        assert_eq!(listed.len(), written.len());
        for s in &listed {
            verify(store, s)
                .await
                .unwrap_or_else(|e| panic!("{s:?}: {e}"));
        }
    }

    // Retention reads each snapshot's lock (a HEAD, which needs the key) before deleting it.
    let retention = etcd_warden::store::gc::Retention {
        policy: etcd_warden::config::GcPolicy::LimitBased { max_backups: 1 },
        delta_retention: std::time::Duration::ZERO,
    };
    let report = etcd_warden::store::gc::run(&streamed.dest, Utc::now(), retention)
        .await
        .expect("the retention pass succeeds");
    assert!(!report.deleted.is_empty(), "{report:?}");

    let requests = proxy.requests();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for r in &requests {
        let mut segments = r.path.trim_start_matches('/').splitn(2, '/');
        let bucket = segments.next().unwrap_or_default();
        let on_object = segments.next().is_some_and(|k| !k.is_empty());
        let copy_source = r.header("x-amz-copy-source");
        let what = match (r.method.as_str(), on_object) {
            (_, false) => continue, // listing, bucket-level
            ("DELETE", _) => continue,
            ("POST", _) if r.query.contains("uploadId") => continue, // completion: no key
            ("POST", _) => "create multipart",
            ("PUT", _) if copy_source.is_some() => "server-side copy",
            ("PUT", _) if r.query.contains("partNumber") => "part",
            ("PUT", _) => "put",
            ("GET", _) => "get",
            ("HEAD", _) => "head",
            _ => continue,
        };
        *seen.entry(what).or_default() += 1;
        let want = md5_of(if bucket == "copies" { 2 } else { 1 });
        assert_eq!(
            (
                r.header("x-amz-server-side-encryption-customer-algorithm"),
                r.header("x-amz-server-side-encryption-customer-key-md5"),
            ),
            (Some("AES256"), Some(want.as_str())),
            "{what} {} {}?{}",
            r.method,
            r.path,
            r.query
        );
        if what == "server-side copy" {
            assert_eq!(
                r.header("x-amz-copy-source-server-side-encryption-customer-key-md5"),
                Some(md5_of(1).as_str()),
                "{r:?}"
            );
        }
    }
    for what in [
        "create multipart",
        "part",
        "put",
        "get",
        "head",
        "server-side copy",
    ] {
        assert!(
            seen.get(what).is_some_and(|n| *n > 0),
            "no {what}: {seen:?}"
        );
    }
    // The copy Job's uploads of a known length are single PUTs, with the key among their
    // signed headers (S3 refuses x-amz-* headers the signature does not cover).
    let copied: Vec<_> = requests
        .iter()
        .filter(|r| r.path.starts_with("/copies/") && (r.method == "PUT" || r.method == "POST"))
        .collect();
    assert!(!copied.is_empty());
    for r in copied {
        assert!(r.method == "PUT" && r.query.is_empty(), "{r:?}");
        let signed = r
            .header("authorization")
            .and_then(|a| a.split("SignedHeaders=").nth(1))
            .and_then(|a| a.split(',').next())
            .unwrap_or_default();
        for header in [
            "x-amz-server-side-encryption-customer-algorithm",
            "x-amz-server-side-encryption-customer-key",
            "x-amz-server-side-encryption-customer-key-md5",
        ] {
            assert!(
                signed.split(';').any(|h| h == header),
                "{header} unsigned: {r:?}"
            );
        }
    }
}

/// The copy Job's single PUTs with server-side encryption, signed over the encryption headers
/// (a presigned URL cannot carry them; that they are among the signed headers is the SSE-C
/// test's), hold valid signatures: s3s-fs, which checks every SigV4 signature (and ignores the
/// encryption itself), takes them, and every copied snapshot reads back whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_puts_with_encryption_headers_are_signed_with_them() {
    let s3 = crate::support::s3::S3Server::start(&["sse-kms", "sse-c"]);
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("customer-key");
    std::fs::write(&key, [3u8; 32]).unwrap();
    let key = key.display().to_string();
    for (bucket, sse) in [
        (
            "sse-kms",
            vec![
                ("store.server_side_encryption", "aws:kms"),
                ("store.sse_kms_key_id", "alias/etcd"),
            ],
        ),
        (
            "sse-c",
            vec![
                ("store.server_side_encryption", "sse-c"),
                ("store.sse_customer_key_file", key.as_str()),
            ],
        ),
    ] {
        let source = format!("file://{}", dir.path().join(bucket).display());
        let stores = stores_from(with(
            s3.config_overrides("store", bucket, "etcd"),
            &[&[("source_store.url", source.as_str())], sse.as_slice()].concat(),
        ));
        let written = write_history(&stores.source).await;
        let report = copy::run(&stores, &options())
            .await
            .unwrap_or_else(|e| panic!("{bucket}: {e}"));
        assert_eq!(report.copied, written.len(), "{bucket}");
        for s in stores.dest.list().await.unwrap() {
            verify(&stores.dest, &s)
                .await
                .unwrap_or_else(|e| panic!("{bucket} {s:?}: {e}"));
        }
    }
}
