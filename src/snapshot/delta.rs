//! Delta snapshots: the payload codec shared with etcd-backup-restore, and a writer that buffers
//! watch events and stores them as `Incr` snapshots.
//!
//! Payload (before compression): a JSON array of `{"etcdEvent": <event>, "time": <RFC3339Nano>}`
//! followed by the raw 32-byte SHA-256 of the array bytes. `<event>` is Go's JSON of etcd's
//! `mvccpb.Event`: `type` omitted for PUT (0) and 1 for DELETE, `kv`/`prev_kv` with `key`,
//! `create_revision`, `mod_revision`, `version`, `value`, `lease`, zero values omitted, bytes in
//! standard base64.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest, Sha256};
use std::sync::Arc;

use crate::store::compression::{self, Codec};
use crate::store::{Kind, Oversized, Snapshot, SnapshotStore, StoreError};

/// Length of the trailing hash.
pub const HASH_LEN: usize = 32;

/// PUT or DELETE, as etcd numbers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EventType {
    /// 0, omitted in JSON.
    #[default]
    Put,
    /// 1.
    Delete,
}

impl EventType {
    fn is_put(&self) -> bool {
        *self == EventType::Put
    }
}

impl Serialize for EventType {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_i32(match self {
            EventType::Put => 0,
            EventType::Delete => 1,
        })
    }
}

impl<'de> Deserialize<'de> for EventType {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match i32::deserialize(d)? {
            0 => Ok(EventType::Put),
            1 => Ok(EventType::Delete),
            n => Err(serde::de::Error::custom(format!(
                "unknown event type {n}; 0 (PUT) or 1 (DELETE)"
            ))),
        }
    }
}

/// etcd's `mvccpb.KeyValue`, with Go's JSON field names.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct KeyValue {
    /// The key.
    #[serde(default, with = "b64", skip_serializing_if = "Vec::is_empty")]
    pub key: Vec<u8>,
    /// Revision of the key's creation.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub create_revision: i64,
    /// Revision of this change.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mod_revision: i64,
    /// The key's version (0 after a delete).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub version: i64,
    /// The value.
    #[serde(default, with = "b64", skip_serializing_if = "Vec::is_empty")]
    pub value: Vec<u8>,
    /// The lease ID, 0 for none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub lease: i64,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

/// etcd's `mvccpb.Event`, with Go's JSON field names.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Event {
    /// PUT or DELETE.
    #[serde(rename = "type", default, skip_serializing_if = "EventType::is_put")]
    pub kind: EventType,
    /// The key-value after the event (for a delete: the key and the deletion revision).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv: Option<KeyValue>,
    /// The key-value before the event, when the watch asked for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prev_kv: Option<KeyValue>,
}

impl Event {
    /// The revision of the change (the kv's mod revision).
    pub fn revision(&self) -> i64 {
        self.kv.as_ref().map_or(0, |kv| kv.mod_revision)
    }

    /// Bytes this event holds, for the memory limit.
    pub fn size(&self) -> usize {
        let kv = |k: &Option<KeyValue>| k.as_ref().map_or(0, |k| k.key.len() + k.value.len() + 32);
        kv(&self.kv) + kv(&self.prev_kv) + 16
    }
}

impl Event {
    /// This event as a packed one reads, received at `time`.
    pub fn view_at(&self, time: DateTime<Utc>) -> EventView<'_> {
        EventView {
            kind: self.kind,
            kv: self.kv.as_ref().map(|kv| KvView {
                key: &kv.key,
                create_revision: kv.create_revision,
                mod_revision: kv.mod_revision,
                version: kv.version,
                value: &kv.value,
                lease: kv.lease,
            }),
            time,
        }
    }
}

impl From<&etcd_client::KeyValue> for KeyValue {
    fn from(kv: &etcd_client::KeyValue) -> Self {
        KeyValue {
            key: kv.key().to_vec(),
            create_revision: kv.create_revision(),
            mod_revision: kv.mod_revision(),
            version: kv.version(),
            value: kv.value().to_vec(),
            lease: kv.lease(),
        }
    }
}

impl From<&etcd_client::Event> for Event {
    fn from(e: &etcd_client::Event) -> Self {
        Event {
            kind: match e.event_type() {
                etcd_client::EventType::Put => EventType::Put,
                etcd_client::EventType::Delete => EventType::Delete,
            },
            kv: e.kv().map(KeyValue::from),
            prev_kv: e.prev_kv().map(KeyValue::from),
        }
    }
}

/// One element of the payload array: an event and when the watcher saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimedEvent {
    /// The event.
    #[serde(rename = "etcdEvent")]
    pub event: Event,
    /// When it was received, RFC 3339 with Go's trimmed nanoseconds.
    #[serde(with = "go_time")]
    pub time: DateTime<Utc>,
}

/// Delta codec errors.
#[derive(Debug, thiserror::Error)]
pub enum DeltaError {
    /// Shorter than its hash.
    #[error("delta payload is {0} bytes, shorter than its 32-byte hash")]
    TooShort(usize),
    /// The hash does not match.
    #[error("delta payload hash mismatch: the snapshot is corrupt")]
    HashMismatch,
    /// Not the expected JSON.
    #[error("delta payload is not an event array: {0}")]
    Json(#[from] serde_json::Error),
    /// Nothing to store.
    #[error("a delta snapshot needs at least one event")]
    Empty,
    /// Reading or writing the store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Decompressing failed.
    #[error("cannot decompress delta: {0}")]
    Io(#[from] std::io::Error),
    /// It decompresses to more than `restore.max_delta_size`: read no further.
    #[error(transparent)]
    TooLarge(Oversized),
}

/// Encodes events as a payload: JSON array then its SHA-256 (uncompressed).
pub fn encode(events: &[TimedEvent]) -> Result<Vec<u8>, DeltaError> {
    let mut out = serde_json::to_vec(events)?;
    let hash = Sha256::digest(&out);
    out.extend_from_slice(&hash);
    Ok(out)
}

/// Encodes and compresses events in one pass at `level` (what is stored). Gzip is one member, as
/// Go writes.
pub fn encode_compressed(
    events: &[TimedEvent],
    codec: Codec,
    level: compression::Level,
) -> Result<Vec<u8>, DeltaError> {
    encode_compressed_to(Vec::new(), events, codec, level)
}

/// [`encode_compressed`] into `out`, which is returned once everything is written to it.
pub fn encode_compressed_to<W: std::io::Write>(
    mut out: W,
    events: &[TimedEvent],
    codec: Codec,
    level: compression::Level,
) -> Result<W, DeltaError> {
    let level = level.flate();
    match codec {
        Codec::None => {
            write_payload(&mut out, events)?;
            Ok(out)
        }
        Codec::Gzip => {
            let mut enc = flate2::write::GzEncoder::new(out, level);
            write_payload(&mut enc, events)?;
            Ok(enc.finish()?)
        }
        Codec::Zlib => {
            let mut enc = flate2::write::ZlibEncoder::new(out, level);
            write_payload(&mut enc, events)?;
            Ok(enc.finish()?)
        }
        Codec::Lzw => Err(DeltaError::Io(std::io::Error::other(
            crate::store::compression::CodecError::WriteUnsupported(codec),
        ))),
    }
}

/// A writer handing what it is given on in chunks of [`CHUNK`] bytes through a channel, from a
/// blocking thread to the upload: the compressed delta is never held whole.
struct ChunkSender {
    tx: tokio::sync::mpsc::Sender<Chunk>,
    buf: Vec<u8>,
}

/// What the encoder sends: data, then `End` once the payload is complete. A channel that closes
/// without `End` (the encoder failed or panicked) fails the upload instead of storing a
/// truncated delta.
enum Chunk {
    Data(Bytes),
    End,
}

/// Bytes per chunk handed from the encoder to the upload.
const CHUNK: usize = 1 << 20;

impl ChunkSender {
    fn send(&mut self, chunk: Chunk) -> std::io::Result<()> {
        self.tx
            .blocking_send(chunk)
            .map_err(|_| std::io::Error::other("the delta's upload stopped"))
    }

    fn send_buffered(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let data = Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK)));
        self.send(Chunk::Data(data))
    }

    /// Sends the rest and says the payload is complete.
    fn finish(mut self) -> std::io::Result<()> {
        self.send_buffered()?;
        self.send(Chunk::End)
    }
}

impl std::io::Write for ChunkSender {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(buf);
        if self.buf.len() >= CHUNK {
            self.send_buffered()?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The payload `events` encode to as `codec` at `level`, encoded on a blocking thread as it is
/// read (a large buffer does not stall the runtime). The stream fails unless the encoder
/// finished; it ends the encoder when dropped.
fn encoded_stream(
    events: std::sync::Arc<Vec<TimedEvent>>,
    count: usize,
    codec: Codec,
    level: compression::Level,
) -> (compression::ByteStream, tokio::task::JoinHandle<()>) {
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    let encoder = tokio::task::spawn_blocking(move || {
        let out = ChunkSender {
            tx,
            buf: Vec::with_capacity(CHUNK),
        };
        let written = encode_compressed_to(out, &events[..count], codec, level);
        // The events go back before the stream can end: the flush takes them back whole.
        drop(events);
        match written {
            Ok(out) => {
                let _ = out.finish();
            }
            Err(e) => tracing::warn!(error = %e, "encoding a delta snapshot failed"),
        }
    });
    let stream = futures::stream::unfold((rx, false), |(mut rx, done)| async move {
        if done {
            return None;
        }
        match rx.recv().await {
            Some(Chunk::Data(data)) => Some((Ok(data), (rx, false))),
            Some(Chunk::End) => None,
            None => Some((
                Err(std::io::Error::other(
                    "the delta's encoder stopped before the payload was complete",
                )),
                (rx, true),
            )),
        }
    });
    (Box::pin(stream), encoder)
}

/// Writes the JSON array, hashing it on the way, then the hash.
fn write_payload<W: std::io::Write>(w: &mut W, events: &[TimedEvent]) -> Result<(), DeltaError> {
    let mut hashing = HashingWriter {
        inner: &mut *w,
        hasher: Sha256::new(),
    };
    serde_json::to_writer(&mut hashing, events)?;
    let hash = hashing.hasher.finalize();
    w.write_all(&hash)?;
    Ok(())
}

/// Passes bytes on while hashing them.
struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
}

impl<W: std::io::Write> std::io::Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Decodes an (uncompressed) payload, checking its hash: every field of every event, as
/// stored (tests and the fuzz targets; restores read packed [`Events`] through [`read_all`]).
pub fn decode(payload: &[u8]) -> Result<Vec<TimedEvent>, DeltaError> {
    let mut chunk = Some(Ok(Bytes::copy_from_slice(payload)));
    decode_into(move || chunk.take(), Vec::new())
}

/// What decoded events go into, one at a time as the array is parsed.
trait Sink: Send + 'static {
    fn push(&mut self, event: TimedEvent);
}

impl Sink for Vec<TimedEvent> {
    fn push(&mut self, event: TimedEvent) {
        Vec::push(self, event);
    }
}

/// Parses the payload the chunks of `next` make into `sink`, one array element at a time, so
/// that beside what the sink keeps it holds one event and the string being read, never the
/// payload's JSON whole. The events count only once the hash checks: a read error comes first,
/// then a payload too short for its hash, then a hash mismatch, then the JSON's own error (a
/// corrupt payload is reported as corrupt whatever its JSON turned into).
fn decode_into<F, S>(next: F, mut sink: S) -> Result<S, DeltaError>
where
    F: FnMut() -> Option<std::io::Result<Bytes>>,
    S: Sink,
{
    let mut payload = HashedPayload::new(next);
    let parsed = {
        let mut reader = std::io::BufReader::with_capacity(64 << 10, &mut payload);
        let mut de = serde_json::Deserializer::from_reader(&mut reader);
        let parsed = serde::Deserializer::deserialize_seq(&mut de, Elements(&mut sink))
            .and_then(|()| de.end());
        if parsed.is_err() {
            // The rest is hashed, not parsed, to tell a corrupt payload from a bad writer.
            let _ = std::io::copy(&mut reader, &mut std::io::sink());
        }
        parsed
    };
    payload.finish()?;
    parsed?;
    Ok(sink)
}

/// The array's elements, each handed to the sink as soon as it is parsed.
struct Elements<'s, S>(&'s mut S);

impl<'de, S: Sink> serde::de::Visitor<'de> for Elements<'_, S> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an array of events")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(event) = seq.next_element::<TimedEvent>()? {
            self.0.push(event);
        }
        Ok(())
    }
}

/// A payload read chunk by chunk: everything but its last [`HASH_LEN`] bytes (the JSON) is
/// passed on and hashed; those are kept to check against the hash. Chunks are passed on from
/// where they lie: at most the hash's length is ever copied.
struct HashedPayload<F> {
    next: F,
    /// Bytes before `chunk` not passed on yet (fewer than the hash's length).
    carried: Vec<u8>,
    chunk: Bytes,
    ended: bool,
    /// The first read error; every read after it fails.
    failed: Option<std::io::Error>,
    total: usize,
    hasher: Sha256,
}

impl<F: FnMut() -> Option<std::io::Result<Bytes>>> HashedPayload<F> {
    fn new(next: F) -> Self {
        Self {
            next,
            carried: Vec::with_capacity(2 * HASH_LEN),
            chunk: Bytes::new(),
            ended: false,
            failed: None,
            total: 0,
            hasher: Sha256::new(),
        }
    }

    /// Bytes known to lie before the last [`HASH_LEN`] of what has been read.
    fn passable(&self) -> usize {
        (self.carried.len() + self.chunk.len()).saturating_sub(HASH_LEN)
    }

    /// Checks what was read: the first read error, the length, then the hash.
    fn finish(mut self) -> Result<(), DeltaError> {
        while !self.ended && self.failed.is_none() {
            self.refill();
        }
        if let Some(e) = self.failed {
            return Err(match Oversized::of(&e) {
                Some(oversized) => DeltaError::TooLarge(oversized.clone()),
                None => DeltaError::Io(e),
            });
        }
        // Whatever was not passed on is the hash (the JSON was read to its end or drained).
        let mut hash = std::mem::take(&mut self.carried);
        hash.extend_from_slice(&self.chunk);
        if self.total < HASH_LEN || hash.len() != HASH_LEN {
            return Err(DeltaError::TooShort(self.total));
        }
        if self.hasher.finalize().as_slice() != hash.as_slice() {
            return Err(DeltaError::HashMismatch);
        }
        Ok(())
    }

    /// Reads the next chunk, carrying the few bytes left of this one.
    fn refill(&mut self) {
        match (self.next)() {
            None => self.ended = true,
            Some(Err(e)) => self.failed = Some(e),
            Some(Ok(next)) => {
                self.total += next.len();
                self.carried.extend_from_slice(&self.chunk);
                self.chunk = next;
            }
        }
    }
}

impl<F: FnMut() -> Option<std::io::Result<Bytes>>> std::io::Read for HashedPayload<F> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        loop {
            if let Some(e) = &self.failed {
                return Err(std::io::Error::new(e.kind(), e.to_string()));
            }
            let passable = self.passable();
            if passable > 0 && !out.is_empty() {
                let n = passable.min(out.len());
                let from_carried = n.min(self.carried.len());
                out[..from_carried].copy_from_slice(&self.carried[..from_carried]);
                self.carried.drain(..from_carried);
                let from_chunk = n - from_carried;
                out[from_carried..n].copy_from_slice(&self.chunk[..from_chunk]);
                self.chunk = self.chunk.slice(from_chunk..);
                self.hasher.update(&out[..n]);
                return Ok(n);
            }
            if self.ended || out.is_empty() {
                return Ok(0);
            }
            self.refill();
        }
    }
}

/// A delta's events as restores read them, packed: each event's fields in a few bytes beside
/// its key and value (never more than its JSON took), in blocks that are never reallocated, so
/// what a delta holds is about what it stores. `prev_kv` is checked when read and not kept:
/// nothing restored uses it. Holds its share of the process's delta budget until dropped.
pub struct Events {
    /// Packed events, in order ([`Events::push`] says how).
    blocks: Vec<Vec<u8>>,
    /// Values of [`OWN_VALUE`] bytes or more, in the allocation they were decoded into.
    values: Vec<Vec<u8>>,
    len: usize,
    charge: Option<Charge>,
}

/// Bytes of a block of packed events.
const PACK_BLOCK: usize = 256 << 10;
/// Values at least this large keep their own allocation instead of being copied into a block.
const OWN_VALUE: usize = 64 << 10;

const DELETE: u8 = 1;
const HAS_KV: u8 = 2;

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events")
            .field("len", &self.len)
            .field("held_bytes", &self.held_bytes())
            .finish()
    }
}

impl Events {
    fn new() -> Self {
        Self {
            blocks: Vec::new(),
            values: Vec::new(),
            len: 0,
            charge: None,
        }
    }

    /// Packs `events` (the fuzz target's and tests' way in; a store read packs as it parses).
    pub fn from_events(events: impl IntoIterator<Item = TimedEvent>) -> Self {
        let mut packed = Events::new();
        for e in events {
            Sink::push(&mut packed, e);
        }
        packed.seal();
        packed
    }

    /// Number of events.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes these events hold in memory (what they keep of the budget).
    pub fn held_bytes(&self) -> u64 {
        let blocks: usize = self.blocks.iter().map(Vec::capacity).sum();
        let values: usize = self.values.iter().map(Vec::capacity).sum();
        let lists = (self.blocks.capacity() + self.values.capacity()) * size_of::<Vec<u8>>();
        (blocks + values + lists) as u64
    }

    /// The events in order, borrowed.
    pub fn views(&self) -> impl Iterator<Item = EventView<'_>> + '_ {
        self.blocks.iter().flat_map(move |block| {
            let mut rest = block.as_slice();
            std::iter::from_fn(move || match rest.is_empty() {
                true => None,
                false => Some(self.unpack(&mut rest)),
            })
        })
    }

    /// The events in order, as owned events (without `prev_kv`).
    pub fn iter(&self) -> impl Iterator<Item = TimedEvent> + '_ {
        self.views().map(|v| v.to_timed())
    }

    /// Shrinks the last block to what it holds: nothing more is added.
    fn seal(&mut self) {
        if let Some(last) = self.blocks.last_mut() {
            last.shrink_to_fit();
        }
    }

    fn unpack<'a>(&'a self, rest: &mut &'a [u8]) -> EventView<'a> {
        let flags = take(rest, 1).first().copied().unwrap_or_default();
        let days = i32::from_le_bytes(take(rest, 4).try_into().unwrap_or_default());
        let secs = u32::from_le_bytes(take(rest, 4).try_into().unwrap_or_default());
        let nanos = u32::from_le_bytes(take(rest, 4).try_into().unwrap_or_default());
        let time = chrono::NaiveDate::from_num_days_from_ce_opt(days)
            .zip(chrono::NaiveTime::from_num_seconds_from_midnight_opt(
                secs, nanos,
            ))
            .map(|(d, t)| d.and_time(t).and_utc())
            .unwrap_or_default();
        let kv = (flags & HAS_KV != 0).then(|| {
            let create_revision = take_varint(rest) as i64;
            let mod_revision = take_varint(rest) as i64;
            let version = take_varint(rest) as i64;
            let lease = take_varint(rest) as i64;
            let key_len = take_varint(rest) as usize;
            let key = take(rest, key_len);
            let tag = take_varint(rest) as usize;
            let value = match tag & 1 {
                0 => take(rest, tag >> 1),
                _ => self.values.get(tag >> 1).map_or(&[][..], Vec::as_slice),
            };
            KvView {
                key,
                create_revision,
                mod_revision,
                version,
                value,
                lease,
            }
        });
        EventView {
            kind: match flags & DELETE {
                0 => EventType::Put,
                _ => EventType::Delete,
            },
            kv,
            time,
        }
    }
}

impl Sink for Events {
    /// One event: flags (delete, has a kv), the time (seconds and nanoseconds, 12 bytes), then
    /// when it has a kv its create and mod revisions, version and lease as varints, the key's
    /// length and bytes, and the value's tag: its length doubled then its bytes, or the index
    /// of its own allocation doubled plus one. Its JSON took at least as much: a field name
    /// and its quotes outweigh any varint, base64 a third more than its bytes.
    fn push(&mut self, event: TimedEvent) {
        let TimedEvent { event, time } = event;
        let mut head = [0u8; 1 + 12 + 6 * 10];
        let mut n = 0;
        let mut put = |bytes: &[u8], n: &mut usize| {
            head[*n..*n + bytes.len()].copy_from_slice(bytes);
            *n += bytes.len();
        };
        let flags = match event.kind {
            EventType::Put => 0,
            EventType::Delete => DELETE,
        } | if event.kv.is_some() { HAS_KV } else { 0 };
        put(&[flags], &mut n);
        // The day, the second in it and the nanosecond: a leap second's 1,000,000,000 and more
        // come back as they went in.
        let naive = time.naive_utc();
        put(
            &chrono::Datelike::num_days_from_ce(&naive.date()).to_le_bytes(),
            &mut n,
        );
        put(
            &chrono::Timelike::num_seconds_from_midnight(&naive.time()).to_le_bytes(),
            &mut n,
        );
        put(
            &chrono::Timelike::nanosecond(&naive.time()).to_le_bytes(),
            &mut n,
        );
        let mut key: &[u8] = &[];
        let mut inline: &[u8] = &[];
        let mut own = None;
        if let Some(kv) = &event.kv {
            let mut v = [0u8; 10];
            for x in [kv.create_revision, kv.mod_revision, kv.version, kv.lease] {
                put(varint_into(&mut v, x as u64), &mut n);
            }
            put(varint_into(&mut v, kv.key.len() as u64), &mut n);
            key = &kv.key;
            if kv.value.len() >= OWN_VALUE {
                own = Some(self.values.len());
            } else {
                inline = &kv.value;
            }
        }
        let mut tag = [0u8; 10];
        let tag: &[u8] = match (&event.kv, own) {
            (None, _) => &[],
            (Some(_), Some(index)) => varint_into(&mut tag, ((index as u64) << 1) | 1),
            (Some(_), None) => varint_into(&mut tag, (inline.len() as u64) << 1),
        };
        let needed = n + key.len() + tag.len() + inline.len();
        let fits = self
            .blocks
            .last()
            .is_some_and(|b| b.capacity() - b.len() >= needed);
        if !fits {
            self.seal();
            self.blocks.push(Vec::with_capacity(needed.max(PACK_BLOCK)));
        }
        if let Some(block) = self.blocks.last_mut() {
            block.extend_from_slice(&head[..n]);
            block.extend_from_slice(key);
            block.extend_from_slice(tag);
            block.extend_from_slice(inline);
        }
        if own.is_some()
            && let Some(kv) = event.kv
        {
            // Moved, not copied: the one large value is never held twice.
            self.values.push(kv.value);
        }
        self.len += 1;
    }
}

/// The first `n` bytes of `rest` (fewer when it is shorter), advancing it.
fn take<'a>(rest: &mut &'a [u8], n: usize) -> &'a [u8] {
    let (head, tail) = rest.split_at(n.min(rest.len()));
    *rest = tail;
    head
}

fn take_varint(rest: &mut &[u8]) -> u64 {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let Some((&byte, tail)) = rest.split_first() else {
            break;
        };
        *rest = tail;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            break;
        }
    }
    v
}

fn varint_into(buf: &mut [u8; 10], mut v: u64) -> &[u8] {
    let mut n = 0;
    while v >= 0x80 {
        buf[n] = (v as u8) | 0x80;
        v >>= 7;
        n += 1;
    }
    buf[n] = v as u8;
    &buf[..n + 1]
}

impl IntoIterator for Events {
    type Item = TimedEvent;
    type IntoIter = std::vec::IntoIter<TimedEvent>;

    /// Every event owned at once (tests, small deltas): restores use [`Events::views`].
    fn into_iter(self) -> Self::IntoIter {
        self.iter().collect::<Vec<_>>().into_iter()
    }
}

/// One packed event, borrowed from its [`Events`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventView<'a> {
    /// PUT or DELETE.
    pub kind: EventType,
    /// The key-value after the event.
    pub kv: Option<KvView<'a>>,
    /// When the watcher received it.
    pub time: DateTime<Utc>,
}

/// A packed event's key-value, borrowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvView<'a> {
    /// The key.
    pub key: &'a [u8],
    /// Revision of the key's creation.
    pub create_revision: i64,
    /// Revision of this change.
    pub mod_revision: i64,
    /// The key's version.
    pub version: i64,
    /// The value.
    pub value: &'a [u8],
    /// The lease ID, 0 for none.
    pub lease: i64,
}

impl EventView<'_> {
    /// The revision of the change (the kv's mod revision).
    pub fn revision(&self) -> i64 {
        self.kv.map_or(0, |kv| kv.mod_revision)
    }

    /// As an owned event (without `prev_kv`, which is not kept).
    pub fn to_timed(&self) -> TimedEvent {
        TimedEvent {
            event: Event {
                kind: self.kind,
                kv: self.kv.map(|kv| KeyValue {
                    key: kv.key.to_vec(),
                    create_revision: kv.create_revision,
                    mod_revision: kv.mod_revision,
                    version: kv.version,
                    value: kv.value.to_vec(),
                    lease: kv.lease,
                }),
                prev_kv: None,
            },
            time: self.time,
        }
    }
}

/// What `verify` needs of a delta: how many events and the revisions of the first and last.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Summary {
    /// Number of events.
    pub events: usize,
    /// Revisions of the first and the last event; `None` without events.
    pub span: Option<(i64, i64)>,
}

impl Sink for Summary {
    fn push(&mut self, event: TimedEvent) {
        let rev = event.event.revision();
        self.events += 1;
        self.span = Some(self.span.map_or((rev, rev), |(first, _)| (first, rev)));
    }
}

/// The process's budget for decoding deltas read with one `max_delta_size`: twice that, shared
/// by every delta in flight, whatever `restore.parallel_fetch` is, and held by decoded deltas
/// until they are used.
struct Budget {
    permits: Arc<tokio::sync::Semaphore>,
    /// Its size in permits of [`UNIT`] bytes.
    units: u32,
}

/// Bytes of one permit (the semaphore counts in `u32`).
const UNIT: u64 = 1 << 10;
/// What a read holds beside its events, charged too: the decoder's pooled buffers and
/// channels, the parse's reader.
const READ_OVERHEAD: u64 = 4 << 20;
/// Deflate's most: 258 bytes from two bits (gzip and zlib alike).
const DEFLATE_RATIO: u64 = 1032;

impl Budget {
    fn of(max_delta_size: u64) -> Arc<Budget> {
        static BUDGETS: std::sync::Mutex<Vec<(u64, Arc<Budget>)>> =
            std::sync::Mutex::new(Vec::new());
        let mut all = BUDGETS.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, b)) = all.iter().find(|(m, _)| *m == max_delta_size) {
            return b.clone();
        }
        let most = u64::from(u32::MAX).min(tokio::sync::Semaphore::MAX_PERMITS as u64);
        let units = (max_delta_size.saturating_mul(2) / UNIT).clamp(1, most) as u32;
        let budget = Arc::new(Budget {
            permits: Arc::new(tokio::sync::Semaphore::new(units as usize)),
            units,
        });
        all.push((max_delta_size, budget.clone()));
        budget
    }

    /// Waits for `bytes` of the budget (all of it at most). Acquired in delta order
    /// ([`Turn`]), so the delta a reader waits for always has its share and nothing waits on a
    /// delta that cannot start.
    async fn take(&self, bytes: u64) -> Charge {
        let units = bytes.div_ceil(UNIT).min(u64::from(self.units)) as u32;
        let units = match self.permits.acquire_many(units).await {
            Ok(permit) => {
                permit.forget();
                units
            }
            // Never closed; were it, nothing is held.
            Err(_) => 0,
        };
        Charge {
            permits: self.permits.clone(),
            units,
        }
    }

    /// Bytes of it held now.
    fn held(&self) -> u64 {
        u64::from(self.units).saturating_sub(self.permits.available_permits() as u64) * UNIT
    }
}

/// Bytes of the process's delta budget (for `max_delta_size`) held now by deltas being read
/// or waiting to be used.
pub fn budget_held(max_delta_size: u64) -> u64 {
    Budget::of(max_delta_size).held()
}

/// A share of the budget, given back when dropped.
#[derive(Debug)]
struct Charge {
    permits: Arc<tokio::sync::Semaphore>,
    units: u32,
}

impl Charge {
    /// Gives back all but `bytes`.
    fn shrink_to(&mut self, bytes: u64) {
        let keep = bytes.div_ceil(UNIT).min(u64::from(self.units)) as u32;
        self.permits.add_permits((self.units - keep) as usize);
        self.units = keep;
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.permits.add_permits(self.units as usize);
    }
}

/// The most a delta stored in `stored` bytes may decompress to: its stored size without
/// compression (age's plaintext is shorter than its file), deflate's ratio for gzip and zlib,
/// and `max_delta_size` always.
fn inflated_bound(codec: Codec, stored: u64, max_delta_size: u64) -> u64 {
    let bound = match codec {
        Codec::None => stored,
        Codec::Gzip | Codec::Zlib => stored.saturating_mul(DEFLATE_RATIO),
        Codec::Lzw => max_delta_size,
    };
    bound.min(max_delta_size)
}

/// What decoding a payload of at most `payload` bytes may hold at once: the events packed (no
/// more than the JSON), the string being parsed (no more than the JSON) and the event it
/// decodes to (three quarters of it), a block being filled, and the read's buffers.
fn reservation(payload: u64) -> u64 {
    payload
        .saturating_add(payload / 4 * 3)
        .saturating_add(PACK_BLOCK as u64)
        .saturating_add(READ_OVERHEAD)
}

/// A delta's place in the order budget is taken in: it waits for the delta before it to have
/// its share, and lets the next go once it has its own (or has failed, or is dropped).
struct Turn {
    after: Option<tokio::sync::oneshot::Receiver<()>>,
    next: tokio::sync::oneshot::Sender<()>,
}

impl Turn {
    /// Lets the next delta take its share.
    fn pass(self) {
        let _ = self.next.send(());
    }

    async fn wait(&mut self) {
        if let Some(after) = self.after.take() {
            // A sender dropped (that delta failed or was given up) lets this one go too.
            let _ = after.await;
        }
    }
}

/// Reads `snapshot` into `sink` within `budget`, in its `turn`: fetched at once, its share
/// of the budget taken in order (bounded by its stored size), parsed on a blocking thread as it
/// streams in. Returns the sink and the share, shrunk to what the sink holds.
async fn read_into<S: Sink>(
    store: &SnapshotStore,
    snapshot: &Snapshot,
    budget: &Budget,
    mut turn: Turn,
    sink: S,
    held: fn(&S) -> u64,
) -> Result<(S, Charge), DeltaError> {
    let got = store.get_decoded_sized(snapshot).await;
    turn.wait().await;
    let (mut stream, stored) = got?;
    let max = store.read_limits().max_delta_size;
    let mut charge = budget
        .take(reservation(inflated_bound(
            snapshot.compression,
            stored,
            max,
        )))
        .await;
    turn.pass();
    let handle = tokio::runtime::Handle::current();
    let sink = tokio::task::spawn_blocking(move || {
        use futures::StreamExt;
        decode_into(|| handle.block_on(stream.next()), sink)
    })
    .await
    .map_err(|e| DeltaError::Io(std::io::Error::other(e)))??;
    charge.shrink_to(held(&sink));
    Ok((sink, charge))
}

/// Reads and decodes `deltas` in order, up to `parallel` at once, within the process's delta
/// budget (twice `restore.max_delta_size`, whatever `parallel` is): many small deltas are read
/// together, large ones as the budget frees. Each comes with its events, which hold their share
/// until dropped.
pub fn read_all<'a>(
    store: &'a SnapshotStore,
    deltas: &'a [Snapshot],
    parallel: usize,
) -> impl futures::Stream<Item = (&'a Snapshot, Result<Events, DeltaError>)> + Send + 'a {
    use futures::StreamExt;
    let budget = Budget::of(store.read_limits().max_delta_size);
    let mut previous = None;
    let turns = deltas.iter().map(move |d| {
        let (next, after) = tokio::sync::oneshot::channel();
        let turn = Turn {
            after: previous.replace(after),
            next,
        };
        (d, turn)
    });
    futures::stream::iter(turns)
        .map(move |(d, turn)| {
            let budget = budget.clone();
            async move {
                let read = read_into(store, d, &budget, turn, Events::new(), Events::held_bytes)
                    .await
                    .map(|(mut events, charge)| {
                        events.seal();
                        events.charge = Some(charge);
                        events
                    });
                (d, read)
            }
        })
        .buffered(parallel.max(1))
}

/// Reads and decodes one stored delta snapshot within the process's delta budget (see
/// [`read_all`]).
pub async fn read(store: &SnapshotStore, snapshot: &Snapshot) -> Result<Events, DeltaError> {
    use futures::StreamExt;
    let mut all = std::pin::pin!(read_all(store, std::slice::from_ref(snapshot), 1));
    match all.next().await {
        Some((_, read)) => read,
        None => Err(DeltaError::Empty),
    }
}

/// Reads a stored delta as [`read`] does, keeping only its [`Summary`] (what `verify` checks).
pub async fn summarize(store: &SnapshotStore, snapshot: &Snapshot) -> Result<Summary, DeltaError> {
    let budget = Budget::of(store.read_limits().max_delta_size);
    let (next, _) = tokio::sync::oneshot::channel();
    let turn = Turn { after: None, next };
    let (summary, _) = read_into(store, snapshot, &budget, turn, Summary::default(), |_| 0).await?;
    Ok(summary)
}

/// Buffers watch events and writes them as delta snapshots.
#[derive(Debug)]
pub struct DeltaWriter {
    codec: Codec,
    /// Last revision of the previous snapshot (full or delta): the next delta starts after it.
    previous_last: i64,
    events: Vec<TimedEvent>,
    buffered: usize,
    /// A delta whose upload failed. The store may hold it all the same (a PUT it performed
    /// and whose answer was lost, or one that completes late), so the next try stores the same
    /// revisions under the same name: a retry replaces the object instead of adding a second
    /// delta over the same revisions, which no chain can restore.
    pending: Option<Snapshot>,
}

impl DeltaWriter {
    /// A writer continuing after a snapshot whose last revision is `previous_last`; the watch
    /// should start at `previous_last + 1`.
    pub fn new(codec: Codec, previous_last: i64) -> Self {
        Self {
            codec,
            previous_last,
            events: Vec::new(),
            buffered: 0,
            pending: None,
        }
    }

    /// The revision a (re)opened watch must start from: after everything stored or buffered.
    pub fn next_revision(&self) -> i64 {
        self.covered() + 1
    }

    /// The last revision stored or buffered.
    fn covered(&self) -> i64 {
        self.events
            .last()
            .map_or(self.previous_last, |e| e.event.revision())
            .max(self.previous_last)
    }

    /// Last revision already stored (or of the base snapshot).
    pub fn previous_last(&self) -> i64 {
        self.previous_last
    }

    /// Restarts after a new full snapshot: drops buffered events it already covers.
    pub fn rebase(&mut self, full_last: i64) {
        // A delta whose upload failed and that ends after the full snapshot is given up: the
        // next delta starts after the full snapshot. If the store holds it all the same, it
        // overlaps the full snapshot, and the chain passes over it for the delta that
        // continues the full snapshot exactly (`layout::latest_chain`).
        self.pending = None;
        self.previous_last = full_last;
        self.events.retain(|e| e.event.revision() > full_last);
        self.buffered = self.events.iter().map(|e| e.event.size()).sum();
    }

    /// Adds the events of one watch response. Revisions already stored or buffered are skipped,
    /// so a watch reopened after an error does not duplicate events.
    pub fn push(&mut self, events: impl IntoIterator<Item = Event>, now: DateTime<Utc>) {
        let covered = self.covered();
        for event in events {
            if event.revision() <= covered {
                continue;
            }
            self.buffered += event.size();
            self.events.push(TimedEvent { event, time: now });
        }
    }

    /// Approximate bytes buffered (compare with `snapshot.delta_memory_limit`).
    pub fn buffered_bytes(&self) -> usize {
        self.buffered
    }

    /// Number of buffered events.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// Whether nothing is buffered.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Stores the buffered events as one delta snapshot; `None` when there is nothing to store.
    /// On failure the events stay buffered for the next try.
    pub async fn flush(&mut self, store: &SnapshotStore) -> Result<Option<Snapshot>, DeltaError> {
        Ok(self.flush_sized(store).await?.map(|(snapshot, _)| snapshot))
    }

    /// [`DeltaWriter::flush`], also returning the bytes stored.
    pub async fn flush_sized(
        &mut self,
        store: &SnapshotStore,
    ) -> Result<Option<(Snapshot, u64)>, DeltaError> {
        // After a failed upload the same revisions go again under the same name; later events
        // wait for the next delta.
        let snapshot = match self.pending.take() {
            Some(pending) => pending,
            None => {
                let Some(last) = self.events.last().map(|e| e.event.revision()) else {
                    return Ok(None);
                };
                store.new_snapshot(Kind::Incr, self.previous_last + 1, last, self.codec, false)
            }
        };
        let last = snapshot.last_revision;
        let count = self.events.partition_point(|e| e.event.revision() <= last);
        let stored = self.store_events(store, &snapshot, count).await;
        let bytes = match stored {
            Ok(bytes) => bytes,
            Err(e) => {
                self.pending = Some(snapshot);
                return Err(e);
            }
        };
        tracing::info!(
            snapshot = %snapshot.snap_name,
            events = count,
            start_revision = snapshot.start_revision,
            last_revision = last,
            "delta snapshot stored"
        );
        self.previous_last = last;
        self.events.drain(..count);
        self.buffered = self.events.iter().map(|e| e.event.size()).sum();
        Ok(Some((snapshot, bytes)))
    }

    /// Stores the first `count` buffered events as `snapshot`; returns the bytes stored. The
    /// events stay buffered whatever happens.
    async fn store_events(
        &mut self,
        store: &SnapshotStore,
        snapshot: &Snapshot,
        count: usize,
    ) -> Result<u64, DeltaError> {
        // Serialised, compressed and encrypted as it is uploaded: beside the events, storing a
        // delta holds a few parts of it, not the whole compressed payload (a backlog after a
        // store outage would otherwise cost its size twice). Encryption reads the recipients'
        // key files here, so a rotated key applies.
        // Shared with the blocking encoder, so the events come back even when it panics or the
        // runtime drops it unstarted (its reference goes with it): a failed flush loses nothing.
        let events = std::sync::Arc::new(std::mem::take(&mut self.events));
        let (payload, encoder) = encoded_stream(
            events.clone(),
            count,
            snapshot.compression,
            store.compression_level(),
        );
        let stored = match store.seal(snapshot, payload) {
            Ok(sealed) => store.put_stream_small_as_one(snapshot, sealed).await,
            Err(e) => Err(e),
        };
        // The stream is gone: the encoder ends (at its next chunk if the upload stopped).
        let _ = encoder.await;
        self.events = std::sync::Arc::try_unwrap(events).unwrap_or_else(|still| (*still).clone());
        Ok(stored?)
    }
}

mod b64 {
    use super::*;

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(v))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = Option::<String>::deserialize(d)?.unwrap_or_default();
        STANDARD.decode(s).map_err(serde::de::Error::custom)
    }
}

/// Go's `time.Time` JSON: RFC 3339 with nanoseconds, trailing zeros (and a zero fraction)
/// trimmed; any offset is accepted when reading.
mod go_time {
    use super::*;

    pub fn format(t: &DateTime<Utc>) -> String {
        let mut s = t.format("%Y-%m-%dT%H:%M:%S").to_string();
        let nanos = t.timestamp_subsec_nanos();
        if nanos != 0 {
            let frac = format!("{nanos:09}");
            s.push('.');
            s.push_str(frac.trim_end_matches('0'));
        }
        s.push('Z');
        s
    }

    pub fn serialize<S: Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format(t))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DateTime<Utc>, D::Error> {
        let s = String::deserialize(d)?;
        DateTime::parse_from_rfc3339(&s)
            .map(|t| t.with_timezone(&Utc))
            .map_err(|e| serde::de::Error::custom(format!("time {s:?}: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn kv(key: &str, value: &str, create: i64, modr: i64, version: i64) -> KeyValue {
        KeyValue {
            key: key.into(),
            create_revision: create,
            mod_revision: modr,
            version,
            value: value.into(),
            lease: 0,
        }
    }

    /// A payload written byte by byte as Go writes it.
    fn hand_built() -> Vec<u8> {
        let json = concat!(
            r#"[{"etcdEvent":{"kv":{"key":"L2Zvbw==","create_revision":5,"mod_revision":5,"version":1,"value":"YmFy"}},"time":"2024-05-10T12:00:00.1234Z"},"#,
            r#"{"etcdEvent":{"type":1,"kv":{"key":"L2Zvbw==","mod_revision":6},"prev_kv":{"key":"L2Zvbw==","create_revision":5,"mod_revision":5,"version":1,"value":"YmFy","lease":7587}},"time":"2024-05-10T14:00:00+02:00"}]"#
        );
        let mut out = json.as_bytes().to_vec();
        out.extend_from_slice(&Sha256::digest(json.as_bytes()));
        out
    }

    #[test]
    fn decodes_a_hand_built_payload() {
        let events = decode(&hand_built()).unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].event.kind, EventType::Put);
        assert_eq!(events[0].event.kv, Some(kv("/foo", "bar", 5, 5, 1)));
        assert_eq!(events[0].event.prev_kv, None);
        assert_eq!(
            events[0].time,
            Utc.with_ymd_and_hms(2024, 5, 10, 12, 0, 0).unwrap()
                + chrono::TimeDelta::nanoseconds(123_400_000)
        );
        assert_eq!(events[1].event.kind, EventType::Delete);
        assert_eq!(events[1].event.revision(), 6);
        assert_eq!(events[1].event.kv.as_ref().unwrap().value, b"");
        assert_eq!(events[1].event.prev_kv.as_ref().unwrap().lease, 7587);
        assert_eq!(
            events[1].time,
            Utc.with_ymd_and_hms(2024, 5, 10, 12, 0, 0).unwrap()
        );
    }

    #[test]
    fn any_flipped_byte_is_rejected() {
        let good = hand_built();
        for i in [
            0,
            10,
            good.len() / 2,
            good.len() - HASH_LEN - 1,
            good.len() - HASH_LEN,
            good.len() - 1,
        ] {
            let mut bad = good.clone();
            bad[i] ^= 0x01;
            assert!(decode(&bad).is_err(), "byte {i} flipped was accepted");
        }
        assert!(matches!(decode(&good[..10]), Err(DeltaError::TooShort(10))));
        let mut bad = good.clone();
        bad[3] ^= 0x01;
        assert!(matches!(decode(&bad), Err(DeltaError::HashMismatch)));
    }

    /// The payload in chunks of every small size: a chunk boundary anywhere, inside the hash
    /// too, decodes alike; what a read error, a short payload or a bad hash is stays so.
    #[test]
    fn decodes_from_chunks_split_anywhere() {
        let good = hand_built();
        let whole = decode(&good).unwrap();
        let chunked = |payload: &[u8], size: usize| {
            let mut chunks = payload
                .chunks(size)
                .map(|c| Ok(Bytes::copy_from_slice(c)))
                .collect::<Vec<_>>()
                .into_iter();
            decode_into(move || chunks.next(), Vec::new())
        };
        for size in [1, 2, 7, 31, 32, 33, 64, good.len()] {
            assert_eq!(chunked(&good, size).unwrap(), whole, "chunks of {size}");
            let mut bad = good.clone();
            bad[3] ^= 0x01;
            assert!(matches!(chunked(&bad, size), Err(DeltaError::HashMismatch)));
            assert!(matches!(
                chunked(&good[..20], size),
                Err(DeltaError::TooShort(20))
            ));
        }
        // Whitespace after the array is JSON's, as it always was.
        let json = &good[..good.len() - HASH_LEN];
        let mut spaced = json.to_vec();
        spaced.extend_from_slice(b" \n");
        spaced.extend_from_slice(&Sha256::digest(&spaced));
        assert_eq!(decode(&spaced).unwrap(), whole);
        // Anything else after it is not, though hashed right.
        let mut trailing = json.to_vec();
        trailing.extend_from_slice(b"[]");
        trailing.extend_from_slice(&Sha256::digest(&trailing));
        assert!(matches!(decode(&trailing), Err(DeltaError::Json(_))));
        // A read error is the error, whatever was parsed.
        let mut chunks = vec![
            Ok(Bytes::copy_from_slice(&good[..40])),
            Err(std::io::Error::other("the store went away")),
        ]
        .into_iter();
        let e = decode_into(move || chunks.next(), Vec::new()).unwrap_err();
        assert!(matches!(e, DeltaError::Io(_)), "{e}");
    }

    /// A leap second, the largest and negative numbers come back as they went in.
    #[test]
    fn packing_keeps_every_field_restores_read() {
        let leap = DateTime::parse_from_rfc3339("2016-12-31T23:59:60.5Z")
            .unwrap()
            .with_timezone(&Utc);
        let events = vec![
            TimedEvent {
                event: Event {
                    kind: EventType::Delete,
                    kv: Some(KeyValue {
                        key: b"k".to_vec(),
                        create_revision: i64::MAX,
                        mod_revision: -1,
                        version: i64::MIN,
                        value: vec![7; OWN_VALUE + 1],
                        lease: 42,
                    }),
                    prev_kv: None,
                },
                time: leap,
            },
            TimedEvent {
                event: Event::default(),
                time: Utc.timestamp_opt(0, 1).unwrap(),
            },
        ];
        let packed = Events::from_events(events.clone());
        assert_eq!(packed.len(), 2);
        assert_eq!(packed.iter().collect::<Vec<_>>(), events);
        assert_eq!(packed.views().next().unwrap().revision(), -1);
    }

    #[test]
    fn encodes_exactly_as_go() {
        let mut events = decode(&hand_built()).unwrap();
        // Go writes the time in the zone it was taken in; ours are UTC.
        events[1].time = Utc.with_ymd_and_hms(2024, 5, 10, 12, 0, 0).unwrap();
        let ours = encode(&events).unwrap();
        let json = String::from_utf8(ours[..ours.len() - HASH_LEN].to_vec()).unwrap();
        assert_eq!(
            json,
            concat!(
                r#"[{"etcdEvent":{"kv":{"key":"L2Zvbw==","create_revision":5,"mod_revision":5,"version":1,"value":"YmFy"}},"time":"2024-05-10T12:00:00.1234Z"},"#,
                r#"{"etcdEvent":{"type":1,"kv":{"key":"L2Zvbw==","mod_revision":6},"prev_kv":{"key":"L2Zvbw==","create_revision":5,"mod_revision":5,"version":1,"value":"YmFy","lease":7587}},"time":"2024-05-10T12:00:00Z"}]"#
            )
        );
        assert_eq!(decode(&ours).unwrap(), events);
    }

    #[test]
    fn one_pass_encoding_matches_the_payload() {
        let events = decode(&hand_built()).unwrap();
        let plain = encode(&events).unwrap();
        assert_eq!(
            encode_compressed(&events, Codec::None, compression::Level::FAST).unwrap(),
            plain
        );
        let gz = encode_compressed(&events, Codec::Gzip, compression::Level::FAST).unwrap();
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut out).unwrap();
        assert_eq!(out, plain);
        let z = encode_compressed(&events, Codec::Zlib, compression::Level::FAST).unwrap();
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::ZlibDecoder::new(&z[..]), &mut out).unwrap();
        assert_eq!(out, plain);
        assert!(encode_compressed(&events, Codec::Lzw, compression::Level::FAST).is_err());
    }

    fn any_kv() -> impl proptest::strategy::Strategy<Value = KeyValue> {
        use proptest::prelude::*;
        (
            prop::collection::vec(any::<u8>(), 0..40),
            0i64..1_000_000,
            0i64..1_000_000,
            0i64..1000,
            prop::collection::vec(any::<u8>(), 0..80),
            prop_oneof![Just(0i64), any::<i64>()],
        )
            .prop_map(|(key, c, m, version, value, lease)| KeyValue {
                key,
                create_revision: c,
                mod_revision: m,
                version,
                value,
                lease,
            })
    }

    proptest::proptest! {
        #[test]
        fn any_events_round_trip(
            events in proptest::collection::vec(
                (any_kv(), proptest::option::of(any_kv()), proptest::bool::ANY, 0i64..4_000_000_000, 0u32..1_000_000_000),
                0..20,
            )
        ) {
            let events: Vec<TimedEvent> = events
                .into_iter()
                .map(|(kv, prev, delete, secs, nanos)| TimedEvent {
                    event: Event {
                        kind: if delete { EventType::Delete } else { EventType::Put },
                        kv: Some(kv),
                        prev_kv: prev,
                    },
                    time: Utc.timestamp_opt(secs, nanos).unwrap(),
                })
                .collect();
            let payload = encode(&events).unwrap();
            proptest::prop_assert_eq!(decode(&payload).unwrap(), events.clone());
            // Packed, they keep all but `prev_kv`, in no more than their JSON (and the lists of
            // blocks).
            let packed = Events::from_events(events.clone());
            let without_prev: Vec<TimedEvent> = events
                .iter()
                .cloned()
                .map(|mut e| {
                    e.event.prev_kv = None;
                    e
                })
                .collect();
            proptest::prop_assert_eq!(packed.iter().collect::<Vec<_>>(), without_prev);
            proptest::prop_assert!(
                packed.held_bytes() <= (payload.len() - HASH_LEN + 128) as u64,
                "{} bytes packed from {} of JSON",
                packed.held_bytes(),
                payload.len() - HASH_LEN
            );
            let json = std::str::from_utf8(&payload[..payload.len() - HASH_LEN]).unwrap();
            // Go omits zero values and the PUT type; it never writes null.
            proptest::prop_assert!(!json.contains(":null"));
            proptest::prop_assert!(!json.contains(r#""type":0"#));
            proptest::prop_assert!(!json.contains(r#""lease":0"#));
        }
    }

    #[test]
    fn writer_skips_covered_revisions_and_rebases() {
        let ev = |rev| Event {
            kind: EventType::Put,
            kv: Some(kv("k", "v", rev, rev, 1)),
            prev_kv: None,
        };
        let now = Utc::now();
        let mut w = DeltaWriter::new(Codec::Gzip, 10);
        assert_eq!(w.next_revision(), 11);
        w.push([ev(9), ev(10), ev(11), ev(12)], now);
        assert_eq!(w.len(), 2);
        assert_eq!(w.next_revision(), 13);
        // A reopened watch replaying buffered revisions adds nothing twice.
        w.push([ev(11), ev(12), ev(13)], now);
        assert_eq!(w.len(), 3);
        w.rebase(11);
        assert_eq!(w.len(), 2);
        assert_eq!(w.next_revision(), 14);
        assert!(w.buffered_bytes() > 0);
    }

    /// The budget is per byte, not per delta: many small deltas are read at once and all held
    /// together (as a writer's queue holds them), and what they hold is given back with them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn small_deltas_are_read_together_within_the_budget() {
        use futures::StreamExt;
        const MAX: u64 = 48 << 20;
        let store = SnapshotStore::new(
            std::sync::Arc::new(object_store::memory::InMemory::new()),
            "p",
        )
        .with_read_limits(crate::store::ReadLimits {
            max_delta_size: MAX,
            ..Default::default()
        });
        let mut deltas = Vec::new();
        for rev in 1..=8 {
            let event = TimedEvent {
                event: Event {
                    kind: EventType::Put,
                    kv: Some(kv("a", "b", rev, rev, 1)),
                    prev_kv: None,
                },
                time: Utc::now(),
            };
            let s = store.new_snapshot(Kind::Incr, rev, rev, Codec::Gzip, false);
            let payload = encode_compressed(&[event], Codec::Gzip, compression::Level::FAST);
            store.put_bytes(&s, payload.unwrap().into()).await.unwrap();
            deltas.push(s);
        }
        let all = tokio::time::timeout(
            std::time::Duration::from_secs(60),
            read_all(&store, &deltas, 8)
                .map(|(_, events)| events.unwrap())
                .collect::<Vec<_>>(),
        )
        .await
        .expect("eight small deltas held together fit the budget");
        assert_eq!(all.iter().map(Events::len).sum::<usize>(), 8);
        let held = budget_held(MAX);
        assert!(held > 0 && held < 8 << 20, "{held} bytes held");
        drop(all);
        assert_eq!(budget_held(MAX), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writer_stores_a_readable_delta() {
        let store = SnapshotStore::new(
            std::sync::Arc::new(object_store::memory::InMemory::new()),
            "p",
        );
        let mut w = DeltaWriter::new(Codec::Gzip, 100);
        assert!(w.flush(&store).await.unwrap().is_none());
        let e = Event {
            kind: EventType::Put,
            kv: Some(kv("a", "b", 101, 101, 1)),
            prev_kv: None,
        };
        w.push([e.clone()], Utc::now());
        let s = w.flush(&store).await.unwrap().unwrap();
        assert_eq!(
            (s.kind, s.start_revision, s.last_revision),
            (Kind::Incr, 101, 101)
        );
        assert!(s.snap_name.ends_with(".gz"));
        assert_eq!(w.next_revision(), 102);
        assert!(w.is_empty());
        let back = read(&store, &s).await.unwrap();
        assert_eq!(back.len(), 1);
        assert_eq!(back.iter().next().unwrap().event, e);
        assert_eq!(store.list().await.unwrap(), vec![s]);
    }
}
