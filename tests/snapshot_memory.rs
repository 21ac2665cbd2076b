//! A full snapshot's memory does not grow with the database: a payload several times larger
//! than the allowed peak goes through hash check, compression and multipart upload. Storing a
//! large delta holds its events and a few parts of the upload, not the compressed payload too.
//! (Its own test binary, so the process's peak RSS belongs to these tests alone; they run one
//! at a time, each from a reset peak.)

use std::io;
use std::sync::Arc;

use bytes::Bytes;
use etcd_warden::snapshot::full::store_payload;
use etcd_warden::store::compression::collect;
use etcd_warden::store::{Codec, Kind, SnapshotStore};
use futures::StreamExt;
use sha2::{Digest, Sha256};

const MIB: usize = 1 << 20;

/// Peak resident memory of this process (VmHWM), in bytes.
fn peak_rss() -> usize {
    status_bytes("VmHWM:")
}

/// Resident memory of this process now (VmRSS), in bytes.
fn rss() -> usize {
    status_bytes("VmRSS:")
}

fn status_bytes(field: &str) -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap();
    let kb: usize = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

/// Holds the process for one test, with its peak reset to what it holds now
/// (`/proc/self/clear_refs`), so that one test's peak is not read as another's.
async fn alone() -> tokio::sync::MutexGuard<'static, ()> {
    static ONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let guard = ONE.lock().await;
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    guard
}

/// One random MiB: deflate's 32 KiB window cannot find its repetitions, so compression cannot
/// hide buffering.
fn block() -> &'static Bytes {
    static BLOCK: std::sync::OnceLock<Bytes> = std::sync::OnceLock::new();
    BLOCK.get_or_init(|| {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut v = vec![0u8; MIB];
        for b in v.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b.copy_from_slice(&x.to_le_bytes()[..b.len()]);
        }
        Bytes::from(v)
    })
}

/// Chunk `i` of a generated database: the random block stamped with its index.
fn chunk(i: usize) -> Bytes {
    let mut v = block().to_vec();
    v[..8].copy_from_slice(&(i as u64).to_le_bytes());
    Bytes::from(v)
}

/// `mib` MiB generated lazily, then etcd's trailing SHA-256 of them.
fn database(mib: usize, hash: Bytes) -> etcd_warden::store::ByteStream {
    futures::stream::iter(0..mib)
        .map(|i| Ok::<_, io::Error>(chunk(i)))
        .chain(futures::stream::once(async move { Ok(hash) }))
        .boxed()
}

fn hash_of(mib: usize) -> Bytes {
    let mut h = Sha256::new();
    for i in 0..mib {
        h.update(chunk(i));
    }
    Bytes::copy_from_slice(&h.finalize())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_stays_bounded_for_a_large_snapshot() {
    let _alone = alone().await;
    let size_mib = 96;
    let hash = hash_of(size_mib);
    let dir = tempfile::tempdir().unwrap();
    let backend =
        Arc::new(object_store::local::LocalFileSystem::new_with_prefix(dir.path()).unwrap());
    let store = SnapshotStore::new(backend, "");
    let before = peak_rss();
    // Gzip exercises everything (read-ahead, parallel members, multipart); without compression
    // the peak is lower still. (Measured: ~36 MiB here, ~37 MiB at 200 MiB: a plateau.)
    let snap = store.new_snapshot(Kind::Full, 0, 1, Codec::Gzip, false);
    store_payload(&store, &snap, database(size_mib, hash), Codec::Gzip)
        .await
        .unwrap();
    let stored = std::fs::metadata(dir.path().join(snap.key()))
        .unwrap()
        .len() as usize;
    assert!(stored > size_mib * MIB * 9 / 10, "{stored} bytes stored");
    store.delete(&snap).await.unwrap();
    let grew = peak_rss().saturating_sub(before);
    println!("peak memory grew by {} MiB", grew / MIB);
    assert!(
        grew < 64 * MIB,
        "peak memory grew by {} MiB for a {size_mib} MiB snapshot",
        grew / MIB
    );
    // And the stored bytes are right (read back as a stream, not kept).
    let snap = store.new_snapshot(Kind::Full, 0, 2, Codec::Gzip, false);
    store_payload(&store, &snap, database(8, hash_of(8)), Codec::Gzip)
        .await
        .unwrap();
    let back = collect(store.get_decoded(&snap).await.unwrap())
        .await
        .unwrap();
    assert_eq!(back.len(), 8 * MIB + 32);
    assert!(back[..MIB] == chunk(0)[..]);
}

/// A delta of 64 MiB of poorly compressible values (a backlog after a store outage, at most
/// `snapshot.delta_memory_limit` plus one watch response) is encoded as it is uploaded: storing
/// it costs a few parts beside its events. Before, the whole compressed payload was built in
/// memory first (about as large as the events again, more while its buffer grew).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storing_a_large_delta_holds_its_events_and_a_few_parts() {
    use etcd_warden::snapshot::delta::{self, DeltaWriter, Event, EventType, KeyValue};
    let _alone = alone().await;
    let events_mib = 64;
    let put = |rev: usize| Event {
        kind: EventType::Put,
        kv: Some(KeyValue {
            key: format!("/registry/k{rev}").into_bytes(),
            create_revision: rev as i64,
            mod_revision: rev as i64,
            version: 1,
            value: chunk(rev).to_vec(),
            lease: 0,
        }),
        prev_kv: None,
    };
    let mut writer = DeltaWriter::new(Codec::Gzip, 0);
    writer.push((1..=events_mib).map(put), chrono::Utc::now());
    let dir = tempfile::tempdir().unwrap();
    let backend =
        Arc::new(object_store::local::LocalFileSystem::new_with_prefix(dir.path()).unwrap());
    let store = SnapshotStore::new(backend, "");
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let before = rss();
    let snap = writer.flush(&store).await.unwrap().unwrap();
    let grew = peak_rss().saturating_sub(before);
    println!("storing the delta grew memory by {} MiB", grew / MIB);
    let stored = std::fs::metadata(dir.path().join(snap.key()))
        .unwrap()
        .len() as usize;
    assert!(stored > events_mib * MIB, "{stored} bytes stored");
    assert!(
        grew < 32 * MIB,
        "storing a delta of {events_mib} MiB of values grew memory by {} MiB",
        grew / MIB
    );
    drop(writer);
    let back = delta::read(&store, &snap).await.unwrap();
    assert_eq!(back.len(), events_mib);
    assert!(back.iter().enumerate().all(|(i, e)| e.event == put(i + 1)));
}

/// The bound restores and `verify` hold deltas to here.
const MAX_DELTA: u64 = 32 << 20;

/// A store whose deltas decompress to at most [`MAX_DELTA`].
fn delta_store(dir: &std::path::Path) -> SnapshotStore {
    let backend = Arc::new(object_store::local::LocalFileSystem::new_with_prefix(dir).unwrap());
    SnapshotStore::new(backend, "").with_read_limits(etcd_warden::store::ReadLimits {
        max_delta_size: MAX_DELTA,
        ..Default::default()
    })
}

/// Stores a gzip delta of tiny events (revisions `first..`) whose JSON is about `json_mib` MiB,
/// written as it is compressed (the events are never held). Returns it and its last revision.
async fn tiny_event_delta(
    store: &SnapshotStore,
    first: i64,
    json_mib: usize,
) -> (etcd_warden::store::Snapshot, i64) {
    use base64::Engine;
    use std::io::Write;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut hash = Sha256::new();
    let mut json = Vec::with_capacity(1 << 17);
    let mut written = 0;
    let mut rev = first;
    json.push(b'[');
    while written + json.len() < json_mib * MIB {
        if rev > first {
            json.push(b',');
        }
        // As Go writes it (what `delta::encode` writes too), by hand: serde_json unoptimised
        // would make this the test's longest part.
        let key = base64::engine::general_purpose::STANDARD.encode(format!("/registry/k{rev}"));
        write!(
            json,
            r#"{{"etcdEvent":{{"kv":{{"key":"{key}","create_revision":{rev},"mod_revision":{rev},"version":1,"value":"dg=="}}}},"time":"2026-12-02T04:04:33.123456789Z"}}"#
        )
        .unwrap();
        rev += 1;
        if json.len() >= 1 << 16 {
            hash.update(&json);
            gz.write_all(&json).unwrap();
            written += json.len();
            json.clear();
        }
    }
    json.push(b']');
    hash.update(&json);
    gz.write_all(&json).unwrap();
    gz.write_all(&hash.finalize()).unwrap();
    let snap = store.new_snapshot(Kind::Incr, first, rev - 1, Codec::Gzip, false);
    store
        .put_bytes(&snap, Bytes::from(gz.finish().unwrap()))
        .await
        .unwrap();
    (snap, rev - 1)
}

/// Four deltas of 30 MiB of tiny events' JSON each (about 230,000 events apiece) in a store
/// whose deltas may reach 32 MiB.
async fn four_large_deltas(store: &SnapshotStore) -> Vec<etcd_warden::store::Snapshot> {
    let mut deltas = Vec::new();
    let mut next = 1;
    for _ in 0..4 {
        let (d, last) = tiny_event_delta(store, next, 30).await;
        deltas.push(d);
        next = last + 1;
    }
    deltas
}

/// Restore's read of deltas with `restore.parallel_fetch` 4, its writer behind a queue as the
/// patcher's is: the whole process stays within twice `max_delta_size` plus 64 MiB. Before,
/// each delta in flight held its JSON whole and its events parsed (several times the JSON for
/// tiny events), times the deltas in flight: 5 M tiny events peaked a restore at 3.76 GB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restoring_deltas_of_tiny_events_stays_within_twice_the_delta_bound() {
    use etcd_warden::snapshot::delta;
    let dir = tempfile::tempdir().unwrap();
    let store = delta_store(dir.path());
    let deltas = four_large_deltas(&store).await;
    let _alone = alone().await;
    let before = rss();
    // The restore's writer: a blocking thread that takes decoded deltas from a short queue.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<delta::Events>(4);
    let writer = tokio::task::spawn_blocking(move || {
        let (mut events, mut last) = (0usize, 0i64);
        while let Some(batch) = rx.blocking_recv() {
            for e in batch.views() {
                assert_eq!(e.revision(), last + 1);
                last = e.revision();
                events += 1;
            }
        }
        (events, last)
    });
    let mut fetched = std::pin::pin!(delta::read_all(&store, &deltas, 4));
    while let Some((d, events)) = fetched.next().await {
        let events = events.unwrap_or_else(|e| panic!("{}: {e}", d.snap_name));
        tx.send(events).await.unwrap();
    }
    drop(tx);
    let (events, last) = writer.await.unwrap();
    let grew = peak_rss().saturating_sub(before);
    println!(
        "reading {events} events in 4 deltas grew memory by {} MiB",
        grew / MIB
    );
    assert_eq!(last, deltas.last().unwrap().last_revision);
    let bound = 2 * MAX_DELTA as usize + 64 * MIB;
    assert!(
        grew < bound,
        "restoring 4 deltas of 30 MiB of tiny events grew memory by {} MiB, more than {} MiB",
        grew / MIB,
        bound / MIB
    );
    assert_eq!(
        delta::budget_held(MAX_DELTA),
        0,
        "the budget is all given back"
    );
}

/// `verify` on the same deltas, one after the other: each counted as it is parsed. Before, a
/// delta was held whole and parsed whole (1.48 GB for 420 MB of JSON).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verifying_deltas_of_tiny_events_stays_within_twice_the_delta_bound() {
    use etcd_warden::snapshot::verify::verify;
    let dir = tempfile::tempdir().unwrap();
    let store = delta_store(dir.path());
    let deltas = four_large_deltas(&store).await;
    let _alone = alone().await;
    let before = rss();
    let mut events = 0;
    for d in &deltas {
        events += verify(&store, d)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .events;
    }
    let grew = peak_rss().saturating_sub(before);
    println!(
        "verifying {events} events grew memory by {} MiB",
        grew / MIB
    );
    assert_eq!(events as i64, deltas.last().unwrap().last_revision);
    // `verify` only counts, so it stays below one delta's bound, well inside the process-wide
    // one (twice the bound plus 64 MiB): at these sizes the process-wide bound alone held
    // before too (71 MiB, the JSON and its parse held whole), and could not have failed.
    let bound = MAX_DELTA as usize;
    assert!(
        grew < bound,
        "verifying deltas of 30 MiB of tiny events grew memory by {} MiB, more than {} MiB",
        grew / MIB,
        bound / MIB
    );
}
