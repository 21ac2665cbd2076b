//! Client-side encryption against real parts: etcd 3.5, the S3 server (s3s-fs) and the `age`
//! command-line tool. Snapshots written with public keys only round-trip through the copy Job
//! (which has no key) into a restore with either private key; without a key, or with the wrong
//! one, a restore fails before it writes anything; an altered byte is never restored.

use crate::support;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use age::secrecy::ExposeSecret;
use etcd_client::Client;
use etcd_warden::config::EncryptionConfig;
use etcd_warden::snapshot::take_full;
use etcd_warden::snapshot::verify::verify;
use etcd_warden::store::compression::collect;
use etcd_warden::store::encryption::AGE_MAGIC;
use etcd_warden::store::{Codec, Kind, SnapshotStore};
use support::etcd::{EtcdCluster, Release};
use support::history::{dump, dump_restored, restore_options, writes};
use support::s3::S3Server;

const SRC: &str = "enc-src";
const DST: &str = "enc-dst";
const PREFIX: &str = "shoot--a/etcd-main";

/// A single etcd 3.5 and a client of it, `n` keys written to it ([`writes`], phase 0);
/// etcd's revision after them.
async fn etcd_written(n: usize) -> (EtcdCluster, Client, i64) {
    let etcd = EtcdCluster::single(Release::V35).await;
    let mut client = etcd.client().await;
    let rev = writes(&mut client, 0, n).await;
    (etcd, client, rev)
}

/// A private key file as `age-keygen` writes it; returns the identity and the file.
fn keygen(dir: &Path, name: &str) -> (age::x25519::Identity, PathBuf) {
    let id = age::x25519::Identity::generate();
    let path = dir.join(format!("{name}.key"));
    std::fs::write(
        &path,
        format!(
            "# created: 2026-11-23T00:00:00Z\n# public key: {}\n{}\n",
            id.to_public(),
            id.to_string().expose_secret()
        ),
    )
    .unwrap();
    (id, path)
}

fn reading_with(identities: &[&Path]) -> EncryptionConfig {
    EncryptionConfig {
        identities: identities.iter().map(|p| p.to_path_buf()).collect(),
        ..Default::default()
    }
}

async fn history(client: &mut Client, store: &SnapshotStore, deltas: usize) -> i64 {
    support::history::build(client, store, 300, deltas, 50).await
}

fn s3_env(s3: &S3Server) -> Vec<(String, String)> {
    let mut env = s3.env("store");
    env.extend(s3.env("source_store"));
    env
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encrypted_snapshots_round_trip_through_copy_and_restore_with_either_key_and_never_without()
{
    let etcd = EtcdCluster::single(Release::V35).await;
    let mut client = etcd.client().await;
    let s3 = S3Server::start(&[SRC, DST]);
    let dir = tempfile::tempdir().unwrap();
    let (team, team_key) = keygen(dir.path(), "team");
    let (glass, glass_key) = keygen(dir.path(), "break-glass");
    let (_, stranger_key) = keygen(dir.path(), "stranger");
    // The team key inline, the break-glass key from a recipients file: what the sidecar holds.
    let recipients_file = dir.path().join("recipients.txt");
    std::fs::write(
        &recipients_file,
        format!("# break-glass\n{}\n", glass.to_public()),
    )
    .unwrap();
    let writing = EncryptionConfig {
        recipients: vec![team.to_public()],
        recipients_files: vec![recipients_file],
        identities: vec![],
    };
    let source = SnapshotStore::new(s3.object_store(SRC), PREFIX).with_encryption(writing);
    let last = history(&mut client, &source, 2).await;
    let original = dump(&mut client).await;

    // Every object is an age file named as one; nothing in it reads as the plaintext.
    let listed = source.list().await.unwrap();
    assert_eq!(listed.len(), 3, "{listed:?}");
    for s in &listed {
        assert!(
            s.encrypted && s.snap_name.contains(".gz.age"),
            "{}",
            s.snap_name
        );
        let stored = collect(source.get_stream(s).await.unwrap()).await.unwrap();
        assert!(stored.starts_with(AGE_MAGIC), "{}", s.snap_name);
        let mut gunzip = flate2::read::GzDecoder::new(&stored[..]);
        assert!(
            gunzip.read_to_end(&mut Vec::new()).is_err(),
            "{} is readable gzip",
            s.snap_name
        );
        assert!(
            !stored.windows(9).any(|w| w == b"secret-0-"),
            "plaintext in {}",
            s.snap_name
        );
    }
    // The sidecar holds no identity: it cannot read what it wrote.
    let e = verify(&source, &listed[0]).await.unwrap_err().to_string();
    assert!(e.contains("no identity is configured"), "{e}");

    // The copy Job has no key: it copies the ciphertext as is.
    let out = support::warden::command()
        .args(["copy", "--source-store", &format!("s3://{SRC}/{PREFIX}")])
        .args(["--dest-store", &format!("s3://{DST}/{PREFIX}")])
        .envs(s3_env(&s3))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("copied 3 snapshots"), "{stderr}");
    let dest = SnapshotStore::new(s3.object_store(DST), PREFIX);
    for s in &listed {
        let a = collect(source.get_stream(s).await.unwrap()).await.unwrap();
        let b = collect(dest.get_stream(s).await.unwrap()).await.unwrap();
        assert!(a == b, "{} changed in the copy", s.snap_name);
    }
    let ls = support::warden::command()
        .args(["ls", "--json", "--store", &format!("s3://{DST}/{PREFIX}")])
        .envs(s3.env("store"))
        .output()
        .unwrap();
    let shown: serde_json::Value = serde_json::from_slice(&ls.stdout).unwrap();
    assert!(
        shown
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["encrypted"] == true),
        "{shown}"
    );

    // Without an identity: one clear line naming the snapshot and the key, nothing written.
    let target = dir.path().join("restored.etcd");
    let restore = |identity: Option<&Path>| {
        let mut c = support::warden::command();
        c.args(["restore", "--store", &format!("s3://{DST}/{PREFIX}")])
            .arg("--data-dir")
            .arg(&target)
            .arg("--etcd-bin")
            .arg(Release::V35.bin_dir())
            .envs(s3.env("store"));
        if let Some(id) = identity {
            c.env("ETCD_WARDEN_ENCRYPTION_IDENTITIES", id);
        }
        c.output().unwrap()
    };
    let full_name = &listed
        .iter()
        .find(|s| s.kind == Kind::Full)
        .unwrap()
        .snap_name;
    let out = restore(None);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(full_name.as_str()) && stderr.contains("encryption.identities"),
        "{stderr}"
    );
    assert!(!target.exists() && !dir.path().join("restored.etcd.part").exists());
    // With a key the snapshots were not encrypted to: the same, naming the key file tried.
    let out = restore(Some(&stranger_key));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("encrypted to other keys") && stderr.contains("stranger.key"),
        "{stderr}"
    );
    assert!(!target.exists());

    // The team key restores through the binary, every key and the revision exact.
    let out = restore(Some(&team_key));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let restored = dump_restored(&target).await;
    assert_eq!(restored.1, last);
    assert!(restored == original, "the restore differs from etcd");

    // So does the break-glass key alone.
    let glass_target = dir.path().join("glass.etcd");
    let reader = SnapshotStore::new(s3.object_store(DST), PREFIX)
        .with_encryption(reading_with(&[&glass_key]));
    let report = etcd_warden::restore::restore(&reader, &restore_options(&glass_target))
        .await
        .unwrap();
    assert_eq!((report.revision, report.deltas), (last, 2));
    assert!(dump_restored(&glass_target).await == original);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_age_tool_decrypts_a_stored_snapshot_and_etcdutl_accepts_the_plaintext() {
    let age_bin = support::require_bin(
        "age",
        &[PathBuf::from("/usr/bin/age")],
        "apt-get install age",
    );
    let keygen_bin = support::require_bin(
        "age-keygen",
        &[PathBuf::from("/usr/bin/age-keygen")],
        "apt-get install age",
    );
    let (_etcd, client, rev) = etcd_written(200).await;
    let dir = tempfile::tempdir().unwrap();
    // Keys made by the standard tool; the sidecar gets the public half only.
    let key = dir.path().join("age.key");
    support::cli::succeeds(Command::new(&keygen_bin).arg("-o").arg(&key));
    let public = support::cli::succeeds(Command::new(&keygen_bin).arg("-y").arg(&key));
    let recipients = dir.path().join("recipients.txt");
    std::fs::write(&recipients, &public.stdout).unwrap();
    let store_dir = dir.path().join("store");
    std::fs::create_dir_all(&store_dir).unwrap();
    let backend = object_store::local::LocalFileSystem::new_with_prefix(&store_dir).unwrap();
    let store =
        SnapshotStore::new(std::sync::Arc::new(backend), "").with_encryption(EncryptionConfig {
            recipients_files: vec![recipients],
            ..Default::default()
        });
    let snap = take_full(&client, &store, Codec::Gzip, true).await.unwrap();
    assert_eq!(
        snap.snap_name,
        format!(
            "Full-00000000-{rev:08}-{}.gz.age.final",
            snap.created_on.timestamp()
        )
    );

    let object = store_dir.join(snap.key());
    let gz = dir.path().join("snapshot.db.gz");
    support::cli::succeeds(
        Command::new(&age_bin)
            .args(["--decrypt", "--identity"])
            .arg(&key)
            .arg("--output")
            .arg(&gz)
            .arg(&object),
    );
    let mut db = Vec::new();
    flate2::read::MultiGzDecoder::new(std::fs::File::open(&gz).unwrap())
        .read_to_end(&mut db)
        .unwrap();
    let db_file = dir.path().join("snapshot.db");
    std::fs::write(&db_file, &db).unwrap();
    let status = support::cli::succeeds(
        Command::new(Release::V35.bin("etcdutl"))
            .args(["snapshot", "status", "--write-out", "json"])
            .arg(&db_file),
    );
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["revision"], rev, "{status}");
    assert!(status["totalKey"].as_u64().unwrap() >= 199, "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_altered_or_truncated_object_fails_verification_and_is_never_restored() {
    let etcd = EtcdCluster::single(Release::V35).await;
    let mut client = etcd.client().await;
    let s3 = S3Server::start(&[SRC]);
    let dir = tempfile::tempdir().unwrap();
    let (id, id_file) = keygen(dir.path(), "team");
    let store =
        SnapshotStore::new(s3.object_store(SRC), PREFIX).with_encryption(EncryptionConfig {
            recipients: vec![id.to_public()],
            identities: vec![id_file],
            ..Default::default()
        });
    history(&mut client, &store, 1).await;
    let listed = store.list().await.unwrap();
    for s in &listed {
        verify(&store, s).await.unwrap();
    }
    let full = listed.iter().find(|s| s.is_full()).unwrap().clone();
    let good = collect(store.get_stream(&full).await.unwrap())
        .await
        .unwrap()
        .to_vec();
    // A byte in the header, one in the middle, the last one; then the object cut short.
    let header_end = good.windows(4).position(|w| w == b"\n---").unwrap() + 50;
    let altered: Vec<(String, Vec<u8>)> = [20, header_end + 10, good.len() / 2, good.len() - 1]
        .into_iter()
        .map(|at| {
            let mut bad = good.clone();
            bad[at] ^= 0x04;
            (format!("byte {at} flipped"), bad)
        })
        .chain([(
            "cut at 2/3".to_string(),
            good[..good.len() * 2 / 3].to_vec(),
        )])
        .collect();
    for (what, bad) in altered {
        store
            .put_bytes(&full, bytes::Bytes::from(bad))
            .await
            .unwrap();
        let e = verify(&store, &full).await.unwrap_err().to_string();
        assert!(e.contains(&full.snap_name), "{what}: {e}");
        let target = dir.path().join("restored.etcd");
        let e = etcd_warden::restore::restore(&store, &restore_options(&target))
            .await
            .unwrap_err()
            .to_string();
        assert!(!target.exists(), "{what}: something was restored ({e})");
        assert!(
            e.contains("failed authentication")
                || e.contains("damaged")
                || e.contains("not a valid age file"),
            "{what}: {e}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_recipients_file_applies_to_the_next_snapshot_without_a_restart() {
    let (_etcd, mut client, _) = etcd_written(20).await;
    let dir = tempfile::tempdir().unwrap();
    let (old, old_key) = keygen(dir.path(), "old");
    let (new, new_key) = keygen(dir.path(), "new");
    let recipients = dir.path().join("recipients.txt");
    std::fs::write(&recipients, format!("{}\n", old.to_public())).unwrap();
    let backend = object_store::memory::InMemory::new();
    let writer =
        SnapshotStore::new(std::sync::Arc::new(backend), "p").with_encryption(EncryptionConfig {
            recipients_files: vec![recipients.clone()],
            ..Default::default()
        });
    let before = take_full(&client, &writer, Codec::Gzip, false)
        .await
        .unwrap();
    std::fs::write(&recipients, format!("# rotated\n{}\n", new.to_public())).unwrap();
    writes(&mut client, 1, 5).await;
    let after = take_full(&client, &writer, Codec::Gzip, false)
        .await
        .unwrap();

    let with = |key: &Path| writer.clone().with_encryption(reading_with(&[key]));
    verify(&with(&old_key), &before).await.unwrap();
    verify(&with(&new_key), &after).await.unwrap();
    assert!(
        verify(&with(&old_key), &after).await.is_err(),
        "the old key still reads new snapshots"
    );
    assert!(
        verify(&with(&new_key), &before).await.is_err(),
        "changing recipients re-encrypted old snapshots"
    );

    // A recipients file that cannot be read fails the snapshot; nothing is written in clear.
    std::fs::remove_file(&recipients).unwrap();
    let e = take_full(&client, &writer, Codec::Gzip, false)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("recipients.txt"), "{e}");
    assert_eq!(writer.list().await.unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_encrypts_its_full_and_delta_snapshots_and_says_so() {
    let (etcd, mut client, _) = etcd_written(30).await;
    let dir = tempfile::tempdir().unwrap();
    let (id, id_file) = keygen(dir.path(), "team");
    let store_dir = dir.path().join("backups");
    let w = support::warden::Warden::start(&[
        ("store.url", format!("file://{}", store_dir.display())),
        ("etcd.endpoints", etcd.endpoints()[0].clone()),
        ("snapshot.delta_period", "300ms".into()),
        ("encryption.recipients", id.to_public().to_string()),
    ]);
    w.wait_up().await;
    // The first full snapshot first: writes before it would be in it, not in a delta.
    let based = support::eventually(std::time::Duration::from_secs(20), || async {
        w.get("/snapshot/latest")
            .await
            .is_some_and(|(code, l)| code == 200 && l["fullSnapshot"].is_object())
    })
    .await;
    assert!(based, "no full snapshot\n{}", w.log_text());
    let rev = writes(&mut client, 1, 10).await;
    let caught_up = support::eventually(std::time::Duration::from_secs(20), || async {
        w.get("/snapshot/latest").await.is_some_and(|(code, l)| {
            code == 200
                && l["deltaSnapshots"]
                    .as_array()
                    .and_then(|d| d.last())
                    .is_some_and(|d| d["lastRevision"] == rev)
        })
    })
    .await;
    let latest = w
        .get("/snapshot/latest")
        .await
        .map(|(_, l)| l)
        .unwrap_or_default();
    assert!(caught_up, "{latest}\n{}", w.log_text());
    assert_eq!(latest["fullSnapshot"]["encrypted"], true, "{latest}");
    assert!(
        latest["deltaSnapshots"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["encrypted"] == true && d["snapName"].as_str().unwrap().ends_with(".gz.age")),
        "{latest}"
    );
    let backend = object_store::local::LocalFileSystem::new_with_prefix(&store_dir).unwrap();
    let reader = SnapshotStore::new(std::sync::Arc::new(backend), "")
        .with_encryption(reading_with(&[&id_file]));
    for s in reader.list().await.unwrap() {
        verify(&reader, &s).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_initializes_from_an_encrypted_store_only_with_a_key() {
    let etcd = EtcdCluster::single(Release::V35).await;
    let mut client = etcd.client().await;
    let dir = tempfile::tempdir().unwrap();
    let (id, id_file) = keygen(dir.path(), "team");
    let store_dir = dir.path().join("store");
    std::fs::create_dir_all(&store_dir).unwrap();
    let backend = object_store::local::LocalFileSystem::new_with_prefix(&store_dir).unwrap();
    let writer =
        SnapshotStore::new(std::sync::Arc::new(backend), "").with_encryption(EncryptionConfig {
            recipients: vec![id.to_public()],
            ..Default::default()
        });
    let last = history(&mut client, &writer, 1).await;
    let original = dump(&mut client).await;
    drop(etcd);

    let data = dir.path().join("vol/data");
    let mut keys = vec![
        ("store.url", format!("file://{}", store_dir.display())),
        (
            "etcd.endpoints",
            format!("http://127.0.0.1:{}", support::free_port()),
        ),
        ("restore.initialize", "true".to_string()),
        ("restore.data_dir", data.display().to_string()),
        (
            "restore.etcd_bin",
            Release::V35.bin_dir().display().to_string(),
        ),
    ];
    let full = writer.latest_chain().await.unwrap().full_snapshot.unwrap();
    let mut keyless = support::warden::Warden::start(&keys);
    let exited = keyless.exit_within(std::time::Duration::from_secs(30));
    let log = keyless.log_text();
    assert!(exited.is_some_and(|s| !s.success()), "{log}");
    assert!(
        log.contains(&full.snap_name) && log.contains("no identity is configured"),
        "{log}"
    );
    assert!(!data.exists() && !dir.path().join("vol/data.part").exists());

    keys.push(("encryption.identities", id_file.display().to_string()));
    let warden = support::warden::Warden::start(&keys);
    let done = support::eventually(std::time::Duration::from_secs(60), || async {
        warden.log_text().contains("restore complete")
    })
    .await;
    assert!(done, "no restore; log:\n{}", warden.log_text());
    drop(warden);
    let restored = dump_restored(&data).await;
    assert_eq!(restored.1, last);
    assert!(restored == original);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_the_age_tool_writes_to_several_recipients_open_within_the_header_bounds() {
    use etcd_warden::store::encryption::{check_header, decrypt, header_reads, read_header};
    use std::str::FromStr;
    let age_bin = support::require_bin(
        "age",
        &[PathBuf::from("/usr/bin/age")],
        "apt-get install age",
    );
    let keygen_bin = support::require_bin(
        "age-keygen",
        &[PathBuf::from("/usr/bin/age-keygen")],
        "apt-get install age",
    );
    let dir = tempfile::tempdir().unwrap();
    let plain: Vec<u8> = (0..200_000u32).map(|i| (i * 31 + i / 97) as u8).collect();
    std::fs::write(dir.path().join("plain"), &plain).unwrap();
    // One key, then five, then 40: age writes one stanza per recipient (rage adds a grease one).
    for count in [1, 5, 40] {
        let mut identities = Vec::new();
        let mut encrypt = Command::new(&age_bin);
        encrypt.arg("--encrypt");
        for i in 0..count {
            let key = dir.path().join(format!("{count}-{i}.key"));
            support::cli::succeeds(Command::new(&keygen_bin).arg("-o").arg(&key));
            let public = support::cli::succeeds(Command::new(&keygen_bin).arg("-y").arg(&key));
            encrypt
                .arg("-r")
                .arg(String::from_utf8(public.stdout).unwrap().trim());
            let text = std::fs::read_to_string(&key).unwrap();
            let secret = text
                .lines()
                .find(|l| l.starts_with("AGE-SECRET-KEY-"))
                .unwrap();
            identities.push(age::x25519::Identity::from_str(secret).unwrap());
        }
        let sealed_path = dir.path().join(format!("sealed-{count}"));
        support::cli::succeeds(
            encrypt
                .arg("--output")
                .arg(&sealed_path)
                .arg(dir.path().join("plain")),
        );
        let sealed = std::fs::read(&sealed_path).unwrap();
        let header = read_header(&mut &sealed[..]).unwrap();
        let stanzas = header.windows(3).filter(|w| w == b"-> ").count();
        assert!(stanzas >= count, "{count} recipients, {stanzas} stanzas");
        // The first, a middle and the last recipient each open it, age parsing the header once.
        for id in [
            &identities[0],
            &identities[count / 2],
            &identities[count - 1],
        ] {
            check_header(&sealed, std::slice::from_ref(id)).unwrap();
            assert_eq!(header_reads(&sealed, std::slice::from_ref(id)).unwrap(), 1);
            let input = etcd_warden::store::compression::once(sealed.clone());
            let back = collect(decrypt(input, vec![id.clone()])).await.unwrap();
            assert!(back == plain, "{count} recipients: the payload differs");
        }
    }
}

/// A `….gz.age` full snapshot that cannot be decrypted (a 2-byte planted name with no identity
/// configured, a damaged MAC, another key, a header beyond its bounds) is skipped for the older
/// full snapshot as a corrupt one is, naming it and why; a delta that cannot be decrypted fails
/// the restore by name with nothing written; with no usable full snapshot left, the error says
/// which were skipped for want of an identity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_snapshot_that_cannot_be_decrypted_is_skipped_for_an_older_one() {
    use etcd_warden::store::encryption::AGE_MAGIC;
    let (_etcd, mut client, dir, plain) = support::etcd_and_file_store().await;
    let store_dir = dir.path().join("store");
    let v2 = store_dir.join("v2");
    let (id, id_key) = keygen(dir.path(), "team");
    let (stranger, _) = keygen(dir.path(), "stranger");
    client.put("before", "1", None).await.unwrap();
    let older = support::stored::gzip_full(&client, &plain).await;
    client.put("after", "2", None).await.unwrap();
    let newer = |n: i64| {
        format!(
            "Full-00000000-{:08}-{}.gz.age",
            older.last_revision + n,
            older.created_on.timestamp() + 60 * n
        )
    };
    let planted = newer(30);
    std::fs::write(v2.join(&planted), b"xx").unwrap();
    let restored_keys =
        |dump: &support::history::Dump| dump.0.iter().map(|kv| kv.0.clone()).collect::<Vec<_>>();

    // Without an identity, through the binary: exit 3, the older state in place.
    let target = dir.path().join("planted.etcd");
    let out = support::warden::command()
        .args([
            "restore",
            "--store",
            &format!("file://{}", store_dir.display()),
        ])
        .arg("--data-dir")
        .arg(&target)
        .arg("--etcd-bin")
        .arg(Release::V35.bin_dir())
        .output()
        .unwrap();
    let stdout = support::cli::fell_back_past(&out, &planted);
    assert!(stdout.contains("no identity is configured"), "{stdout}");
    let restored = dump_restored(&target).await;
    assert_eq!(restored.1, older.last_revision);
    assert_eq!(restored_keys(&restored), [b"before".to_vec()]);

    // With identities configured: the planted name, then a full snapshot whose MAC is damaged,
    // one encrypted to another key, one whose header has too many stanzas.
    let reading = plain.clone().with_encryption(reading_with(&[&id_key]));
    let encrypted_to = |key: &age::x25519::Identity| {
        plain.clone().with_encryption(EncryptionConfig {
            recipients: vec![key.to_public()],
            ..Default::default()
        })
    };
    let damaged = support::stored::gzip_full(&client, &encrypted_to(&id)).await;
    let object = v2.join(&damaged.snap_name);
    let mut bytes = std::fs::read(&object).unwrap();
    let mac = bytes.windows(5).position(|w| w == b"\n--- ").unwrap() + 10;
    bytes[mac] = if bytes[mac] == b'A' { b'B' } else { b'A' };
    std::fs::write(&object, &bytes).unwrap();
    // A write between, so that the two are two snapshots, not one name written twice.
    client.put("later", "3", None).await.unwrap();
    let others = support::stored::gzip_full(&client, &encrypted_to(&stranger)).await;
    let stanzas = newer(40);
    let mut quadratic = AGE_MAGIC.to_vec();
    quadratic.extend_from_slice(&b"-> a\n\n".repeat(2_000));
    std::fs::write(v2.join(&stanzas), &quadratic).unwrap();
    let mut opts = restore_options(&dir.path().join("keyed.etcd"));
    opts.fallback = true;
    let report = etcd_warden::restore::restore(&reading, &opts)
        .await
        .unwrap();
    assert_eq!(
        report.full_snapshot, older.snap_name,
        "{:?}",
        report.skipped
    );
    let why = |name: &str| {
        report
            .skipped
            .iter()
            .find(|s| s.snapshot == name)
            .map(|s| s.reason.clone())
            .unwrap_or_else(|| panic!("{name} not skipped: {:?}", report.skipped))
    };
    assert!(
        why(&planted).contains("not a valid age file"),
        "{}",
        why(&planted)
    );
    assert!(
        why(&damaged.snap_name).contains("damaged"),
        "{}",
        why(&damaged.snap_name)
    );
    assert!(why(&others.snap_name).contains("encrypted to other keys"));
    assert!(
        why(&stanzas).contains("more than 256 stanzas"),
        "{}",
        why(&stanzas)
    );
    assert!(why(&planted).contains("team.key"), "{}", why(&planted));
    assert_eq!(report.skipped.len(), 4, "{:?}", report.skipped);
    assert_eq!(dump_restored(&opts.data_dir).await.1, older.last_revision);
    for s in [&damaged, &others] {
        plain.delete(s).await.unwrap();
    }
    std::fs::remove_file(v2.join(&stanzas)).unwrap();

    // A delta continuing the older snapshot that cannot be decrypted fails by name, as a
    // corrupt delta does, and nothing is written.
    let delta = format!(
        "Incr-{:08}-{:08}-{}.gz.age",
        older.last_revision + 1,
        older.last_revision + 5,
        older.created_on.timestamp() + 10
    );
    std::fs::write(v2.join(&delta), b"xx").unwrap();
    let mut opts = restore_options(&dir.path().join("delta.etcd"));
    opts.fallback = true;
    let e = etcd_warden::restore::restore(&plain, &opts)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains(&delta) && e.contains("no identity"), "{e}");
    assert!(!opts.data_dir.exists() && !dir.path().join("delta.etcd.part").exists());
    std::fs::remove_file(v2.join(&delta)).unwrap();

    // No usable full snapshot left (the older one cut short): the error still says the planted
    // one was skipped for want of an identity.
    let object = v2.join(&older.snap_name);
    let bytes = std::fs::read(&object).unwrap();
    std::fs::write(&object, &bytes[..bytes.len() / 2]).unwrap();
    let mut opts = restore_options(&dir.path().join("none.etcd"));
    opts.fallback = true;
    let e = etcd_warden::restore::restore(&plain, &opts)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&older.snap_name)
            && e.contains("no earlier full snapshot")
            && e.contains(&format!(
                "no identity configured to decrypt them: {planted}"
            ))
            && e.contains("encryption.identities"),
        "{e}"
    );
    assert!(!opts.data_dir.exists());
}
