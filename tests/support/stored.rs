//! Snapshots written straight into a store with valid payloads (no etcd): a full snapshot's
//! database bytes followed by their SHA-256 as etcd streams them, a delta's events as the
//! sidecar encodes them. They pass `verify` and copy's hash checks.

use bytes::Bytes;
use chrono::{TimeZone, Utc};
use etcd_warden::snapshot::delta::{self, Event, KeyValue, TimedEvent};
use etcd_warden::store::compression::{collect, once};
use etcd_warden::store::{Codec, Kind, Snapshot, SnapshotStore};
use sha2::{Digest, Sha256};

/// A fake etcd snapshot: `len` bytes then their SHA-256, as etcd streams it.
pub fn db_payload(len: usize, seed: u8) -> Vec<u8> {
    let mut db: Vec<u8> = (0..len)
        .map(|i| ((i as u64).wrapping_mul(2654435761) >> 13) as u8 ^ seed)
        .collect();
    let h = Sha256::digest(&db);
    db.extend_from_slice(&h);
    db
}

/// Stores a full snapshot; returns it.
pub async fn put_full(
    store: &SnapshotStore,
    last: i64,
    at: i64,
    len: usize,
    codec: Codec,
    is_final: bool,
) -> Snapshot {
    let s = Snapshot::new(
        store.prefix(),
        Kind::Full,
        0,
        last,
        Utc.timestamp_opt(at, 0).unwrap(),
        codec,
        is_final,
    );
    let raw = db_payload(len, last as u8);
    let stored = collect(
        codec
            .encode(once(raw), 2, etcd_warden::store::compression::Level::FAST)
            .unwrap(),
    )
    .await
    .unwrap();
    store.put_bytes(&s, Bytes::from(stored)).await.unwrap();
    s
}

/// Stores a delta with one PUT per revision in `start..=last`.
pub async fn put_delta(store: &SnapshotStore, start: i64, last: i64, at: i64) -> Snapshot {
    let events: Vec<TimedEvent> = (start..=last)
        .map(|rev| TimedEvent {
            event: Event {
                kv: Some(KeyValue {
                    key: format!("/k/{rev}").into_bytes(),
                    create_revision: rev,
                    mod_revision: rev,
                    version: 1,
                    value: b"v".to_vec(),
                    lease: 0,
                }),
                ..Default::default()
            },
            time: Utc.timestamp_opt(at, 0).unwrap(),
        })
        .collect();
    let s = Snapshot::new(
        store.prefix(),
        Kind::Incr,
        start,
        last,
        Utc.timestamp_opt(at, 0).unwrap(),
        Codec::Gzip,
        false,
    );
    let bytes = delta::encode_compressed(&events, Codec::Gzip, Default::default()).unwrap();
    store.put_bytes(&s, Bytes::from(bytes)).await.unwrap();
    s
}

/// A gzip full snapshot of the etcd behind `client`, taken now, which must succeed.
pub async fn gzip_full(client: &etcd_client::Client, store: &SnapshotStore) -> Snapshot {
    etcd_warden::snapshot::take_full(client, store, etcd_warden::store::Codec::Gzip, false)
        .await
        .unwrap()
}

/// Whether `store`'s newest snapshot ends at revision `r` (false while it cannot be listed).
pub async fn newest_at(store: SnapshotStore, r: i64) -> bool {
    store
        .list()
        .await
        .is_ok_and(|l| l.last().map(|s| s.last_revision) == Some(r))
}
