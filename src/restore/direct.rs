//! Delta events written straight into the full snapshot's database file.
//!
//! etcd keeps every revision of every key in the bbolt bucket `key`: the bbolt key is the
//! revision (8 bytes big-endian main revision, `_`, 8 bytes big-endian sub-revision, and a
//! trailing `t` for a deletion), the value etcd's `mvccpb.KeyValue` in protobuf. On start etcd
//! rebuilds its index from that bucket, and its current revision is the highest main revision
//! in it (or the finished compaction, if higher). A delta event carries exactly what etcd wrote
//! for it (key, create revision, modification revision, version, value), so appending one record
//! per event after the snapshot's last one gives the database etcd itself would have had, at a
//! few hundred thousand events a second instead of one transaction per revision.
//!
//! Checked as it goes: revisions continue the snapshot's without a gap (a missing delta), never
//! go back, and every put carries its create revision and version. Deltas this cannot write (an
//! event without those fields, a database whose shape [`super::bolt`] does not know) come back as
//! [`Outcome::Unsupported`] and the caller replays them through etcd instead. The result's
//! revision is checked before it is used (read back from the file, or by a temporary etcd where
//! etcd's own tool restores it).
//!
//! The fetched snapshot is patched in place, as a bbolt write transaction would change it
//! ([`Patcher`]): the records go into new pages for the `key` bucket's rightmost path, the
//! few small buckets a restore changes are written anew, and a new meta page commits it, so
//! the database is written once (fetched), not fetched and then rewritten, and memory stays flat
//! whatever its size. etcd's own restore tool changes its copy the same way (through bbolt).
//! [`Membership`] carries what etcd's snapshot restore changes for a new cluster, so the patched
//! file is the member's database itself.
//!
//! As in the replay through etcd, leases are dropped: a put keeps no lease.
//!
//! Two options shape the result ([`Plan`]): a point in time stops the writing at the first event
//! after it (a revision's events all or none: a transaction is one revision), and a revision bump
//! ends the `key` bucket with one empty record `by` revisions above the last (etcd's own
//! `etcdutl snapshot restore --bump-revision`), optionally with `scheduledCompactRev` set to it in
//! `meta` (`--mark-compacted`), so etcd compacts everything below on start and a watch from an
//! earlier revision fails as compacted instead of silently missing events. etcdutl bumps from
//! the last record; this bumps from the revision etcd starts at, which is higher when a
//! compaction removed the last record.

use std::path::Path;

use futures::StreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use chrono::{DateTime, Utc};

use super::bolt::{BoltError, Bucket, Patcher, Reader, Root, Tree};
use super::member_dir::{Cluster, Release};
use super::{RestoreError, RevisionBump, StepExt};
use crate::snapshot::delta::{self, EventType, EventView};
use crate::store::layout::Target;
use crate::store::{Snapshot, SnapshotStore};

/// etcd's bucket of revisions.
pub(super) const KEY_BUCKET: &[u8] = b"key";
/// etcd's bucket of bookkeeping, and the key of the last finished compaction in it.
const META_BUCKET: &[u8] = b"meta";
const FINISHED_COMPACT: &[u8] = b"finishedCompactRev";
/// The compaction etcd resumes on start when it is above the finished one.
const SCHEDULED_COMPACT: &[u8] = b"scheduledCompactRev";
/// The buckets of the membership etcd 3.5's restore rewrites.
const MEMBERS: &[u8] = b"members";
const MEMBERS_REMOVED: &[u8] = b"members_removed";
const CLUSTER: &[u8] = b"cluster";
/// Deltas decoded ahead of the writer.
const QUEUE: usize = 4;

/// Where the written database stops, what it says of the revisions after it and of the cluster
/// it now belongs to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Stop at this point in time; `None`: every event.
    pub until: Option<Target>,
    /// The revision bump after the last event.
    pub bump: RevisionBump,
    /// The new cluster's membership, written as etcd's snapshot restore writes it; `None`
    /// leaves that to etcd's tool.
    pub membership: Option<Membership>,
}

/// What etcd's snapshot restore changes in the database for a new cluster
/// ([`super::member_dir`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Membership {
    /// The new `members` bucket, keys ascending: `members_removed` is emptied with it, and
    /// `cluster` created if missing (etcd 3.5). `None`: the three buckets are copied (3.4).
    pub members: Option<Vec<(Vec<u8>, Vec<u8>)>>,
    /// Keys set in `meta` (the consistent index, the term), ascending.
    pub meta: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Membership {
    /// What `release`'s tool writes for `cluster`.
    pub fn of(cluster: &Cluster, release: Release) -> Membership {
        Membership {
            members: (release == Release::V35).then(|| cluster.members_bucket()),
            meta: cluster
                .meta(release)
                .into_iter()
                .map(|(k, v)| (k.to_vec(), v))
                .collect(),
        }
    }
}

/// What writing the deltas into the database came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Written: events added (those already in the snapshot are not counted), the revision of
    /// the last one (the snapshot's own when there was none), the snapshot's revision, the
    /// revision etcd starts at (above `revision` by the bump) and when the last event written
    /// was received.
    Done {
        events: u64,
        revision: i64,
        restored: i64,
        etcd_revision: i64,
        last_event_time: Option<DateTime<Utc>>,
    },
    /// Not written, for this reason; replay through etcd instead.
    Unsupported(String),
}

/// The bbolt key of revision (`main`, `sub`).
pub fn revision_key(main: i64, sub: i64, tombstone: bool) -> Vec<u8> {
    let mut key = Vec::with_capacity(18);
    key.extend_from_slice(&main.to_be_bytes());
    key.push(b'_');
    key.extend_from_slice(&sub.to_be_bytes());
    if tombstone {
        key.push(b't');
    }
    key
}

/// The main revision of a bbolt key of the `key` bucket (or of `finishedCompactRev`).
fn main_revision(key: &[u8]) -> Result<i64, BoltError> {
    let bytes: [u8; 8] = key
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| BoltError::Unsupported(format!("a revision key of {} bytes", key.len())))?;
    Ok(i64::from_be_bytes(bytes))
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// etcd's `mvccpb.KeyValue` in protobuf (fields 1–5; zero values omitted, as Go encodes them).
pub fn encode_kv(
    key: &[u8],
    create_revision: i64,
    mod_revision: i64,
    version: i64,
    value: &[u8],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(key.len() + value.len() + 40);
    let bytes = |out: &mut Vec<u8>, tag: u8, b: &[u8]| {
        if !b.is_empty() {
            out.push(tag);
            varint(out, b.len() as u64);
            out.extend_from_slice(b);
        }
    };
    bytes(&mut out, 0x0a, key);
    for (tag, n) in [
        (0x10, create_revision),
        (0x18, mod_revision),
        (0x20, version),
    ] {
        if n != 0 {
            out.push(tag);
            varint(&mut out, n as u64);
        }
    }
    bytes(&mut out, 0x2a, value);
    out
}

/// The fields of an `mvccpb.KeyValue` a restore compares (the lease is left out: restores drop
/// it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DecodedKv {
    pub key: Vec<u8>,
    pub create_revision: i64,
    pub mod_revision: i64,
    pub version: i64,
    pub value: Vec<u8>,
}

/// Decodes etcd's `mvccpb.KeyValue` protobuf (the inverse of [`encode_kv`]; unknown fields are
/// skipped as protobuf allows).
pub fn decode_kv(mut b: &[u8]) -> Result<DecodedKv, BoltError> {
    fn read_varint(b: &mut &[u8]) -> Result<u64, BoltError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = b
                .split_first()
                .ok_or_else(|| BoltError::Corrupt("a truncated KeyValue varint".into()))?;
            *b = rest;
            v |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(BoltError::Corrupt("a KeyValue varint over 64 bits".into()))
    }
    let mut kv = DecodedKv::default();
    while !b.is_empty() {
        let tag = read_varint(&mut b)?;
        match (tag >> 3, tag & 7) {
            (field, 0) => {
                let n = read_varint(&mut b)? as i64;
                match field {
                    2 => kv.create_revision = n,
                    3 => kv.mod_revision = n,
                    4 => kv.version = n,
                    _ => {}
                }
            }
            (field, 2) => {
                let len = usize::try_from(read_varint(&mut b)?).unwrap_or(usize::MAX);
                if len > b.len() {
                    return Err(BoltError::Corrupt("a truncated KeyValue field".into()));
                }
                let (bytes, rest) = b.split_at(len);
                b = rest;
                match field {
                    1 => kv.key = bytes.to_vec(),
                    5 => kv.value = bytes.to_vec(),
                    _ => {}
                }
            }
            (field, wire) => {
                return Err(BoltError::Unsupported(format!(
                    "KeyValue field {field} of wire type {wire}"
                )));
            }
        }
    }
    Ok(kv)
}

/// A record of the `key` bucket: (revision key, `mvccpb.KeyValue`).
type Record = (Vec<u8>, Vec<u8>);

/// Where the appended records stand.
struct Cursor {
    /// The snapshot's revision: events at or below it are already in it.
    restored: i64,
    /// The revision of the last record written and the next sub-revision within it.
    revision: i64,
    sub: i64,
    events: u64,
    /// Where to stop; `None`: never.
    until: Option<Target>,
    /// When the last event written was received.
    last_time: Option<DateTime<Utc>>,
}

impl Cursor {
    fn new(restored: i64, until: Option<Target>) -> Cursor {
        Cursor {
            restored,
            revision: restored,
            sub: 0,
            events: 0,
            until,
            last_time: None,
        }
    }

    /// Whether `event`, received at `time`, is past the target: the first event of a revision
    /// after it. The rest of a revision already begun is never past it.
    fn past_target(&self, event: &EventView, time: DateTime<Utc>) -> bool {
        let rev = event.revision();
        if rev <= self.restored || (rev == self.revision && self.revision > self.restored) {
            return false;
        }
        match self.until {
            None => false,
            Some(Target::Revision(r)) => rev > r,
            Some(Target::Time(t)) => time > t,
        }
    }

    /// The record for `event` from delta `name`: `Ok(None)` when the snapshot already has it.
    fn record(&mut self, event: &EventView, name: &str) -> Result<Option<Record>, Fail> {
        let kv = event
            .kv
            .ok_or_else(|| Fail::Deltas(format!("delta {name}: an event without a key")))?;
        let rev = kv.mod_revision;
        if rev <= self.restored {
            return Ok(None);
        }
        if rev == self.revision {
            self.sub += 1;
        } else if rev == self.revision + 1 {
            self.revision = rev;
            self.sub = 0;
        } else if rev < self.revision {
            return Err(Fail::Deltas(format!(
                "delta {name}: events out of order: revision {rev} after {}",
                self.revision
            )));
        } else {
            return Err(Fail::Deltas(format!(
                "delta {name}: revisions {} to {} are missing (a delta is lost or the chain \
                 is broken): the events so far end at {} and this delta continues at {rev}",
                self.revision + 1,
                rev - 1,
                self.revision
            )));
        }
        if kv.key.is_empty() {
            return Err(Fail::Deltas(format!(
                "delta {name}: an event at revision {rev} with an empty key"
            )));
        }
        self.events += 1;
        // Planted (`crate::plant`): a delete is skipped (its revision still counted).
        if event.kind == EventType::Delete && crate::plant::active("drop-delete-in-restore") {
            return Ok(None);
        }
        Ok(Some(match event.kind {
            EventType::Put => {
                if kv.create_revision <= 0 || kv.create_revision > rev || kv.version <= 0 {
                    return Err(Fail::Unsupported(format!(
                        "delta {name}: the put at revision {rev} has create revision {} and \
                         version {}",
                        kv.create_revision, kv.version
                    )));
                }
                // Planted (`crate::plant`): the value changed, every revision kept.
                if crate::plant::active("restore-alters-values") {
                    let altered = [kv.value, b"~"].concat();
                    return Ok(Some((
                        revision_key(rev, self.sub, false),
                        encode_kv(kv.key, kv.create_revision, rev, kv.version, &altered),
                    )));
                }
                (
                    revision_key(rev, self.sub, false),
                    encode_kv(kv.key, kv.create_revision, rev, kv.version, kv.value),
                )
            }
            EventType::Delete => (
                revision_key(rev, self.sub, true),
                encode_kv(kv.key, 0, 0, 0, &[]),
            ),
        }))
    }
}

/// Why the writer stopped.
enum Fail {
    /// A real error in the deltas or the files: the restore fails.
    Deltas(String),
    Io(std::io::Error),
    /// Cannot be written directly: replay through etcd.
    Unsupported(String),
    /// The fetching side gave up (its own error is reported), or the restore was dropped.
    Aborted,
}

impl From<BoltError> for Fail {
    fn from(e: BoltError) -> Self {
        match e {
            BoltError::Io(e) => Fail::Io(e),
            BoltError::Cancelled => Fail::Aborted,
            // etcd's own tool judges the file next; a layout this reader does not know is no
            // reason to fail a restore the replay through etcd can do.
            e @ (BoltError::Corrupt(_) | BoltError::Unsupported(_)) => {
                Fail::Unsupported(e.to_string())
            }
        }
    }
}

/// A decoded delta, or the fetching side giving up.
type Batch = Result<(String, delta::Events), ()>;

/// Patches `snapshot_db` (etcd's snapshot file: `db_len` bytes of database, then its hash) with
/// every event of `deltas` appended and moves it to `out`, a database without a hash. Deltas
/// are fetched and decoded `parallel` ahead of the writer, within the process's delta budget
/// ([`delta::read_all`]): a decoded delta queued for the writer holds its share until written. Unless it is [`Outcome::Done`],
/// `snapshot_db` is left as it was fetched.
pub async fn write(
    store: &SnapshotStore,
    deltas: &[Snapshot],
    parallel: usize,
    snapshot_db: &Path,
    db_len: u64,
    out: &Path,
    plan: Plan,
) -> Result<Outcome, RestoreError> {
    let (tx, rx) = mpsc::channel::<Batch>(QUEUE);
    let cancel = CancellationToken::new();
    let feed = Feed {
        tx,
        cancel: cancel.clone(),
        finished: false,
    };
    let (input, output) = (snapshot_db.to_path_buf(), out.to_path_buf());
    let writer = tokio::task::spawn_blocking(move || {
        write_blocking(&input, db_len, &output, rx, plan, &cancel)
    });
    let mut fetched = std::pin::pin!(delta::read_all(store, deltas, parallel));
    let mut fetch_error = None;
    while let Some((d, events)) = fetched.next().await {
        match events {
            Ok(events) => {
                if feed
                    .tx
                    .send(Ok((d.snap_name.clone(), events)))
                    .await
                    .is_err()
                {
                    break; // the writer stopped (an error, or the target reached)
                }
            }
            Err(e) => {
                fetch_error = Some(RestoreError::Delta {
                    name: d.snap_name.clone(),
                    cause: e,
                });
                let _ = feed.tx.send(Err(())).await;
                break;
            }
        }
    }
    feed.finish();
    let written = writer.await.map_err(|cause| RestoreError::Task {
        what: "the database writer failed",
        cause,
    })?;
    if let Some(e) = fetch_error {
        return Err(e).step("fetching and verifying deltas");
    }
    match written {
        Ok(done) => Ok(done),
        Err(Fail::Unsupported(reason)) => Ok(Outcome::Unsupported(reason)),
        Err(Fail::Deltas(e)) => Err(RestoreError::Deltas(e)),
        Err(Fail::Io(cause)) => Err(RestoreError::Io {
            path: format!("writing {}", out.display()),
            cause,
        }),
        Err(Fail::Aborted) => Err(RestoreError::Deltas("fetching the deltas failed".into())),
    }
}

/// The sending side of the writer's queue. Dropped unfinished (the restore's future dropped: a
/// signal stops a one-shot command so), it cancels the writer before the queue closes, so the
/// writer stops at its next page or batch instead of holding the process (the runtime waits for
/// its blocking threads) and never takes the closed queue for the end of the deltas.
struct Feed {
    tx: mpsc::Sender<Batch>,
    cancel: CancellationToken,
    /// Every delta was sent (or the fetching failed and said so).
    finished: bool,
}

impl Feed {
    /// Closes the queue: the writer has every delta.
    fn finish(mut self) {
        self.finished = true;
    }
}

impl Drop for Feed {
    fn drop(&mut self) {
        // Runs before the sender (a field) is dropped, which closes the queue.
        if !self.finished {
            self.cancel.cancel();
        }
    }
}

/// The revision etcd starts at on this database: the highest main revision in the `key` bucket,
/// or the finished compaction if higher (a compaction can remove the last revision, a delete).
pub fn database_revision(reader: &Reader, buckets: &[Bucket]) -> Result<i64, BoltError> {
    let key_bucket = buckets
        .iter()
        .find(|b| b.name == KEY_BUCKET)
        .ok_or_else(|| BoltError::Unsupported("no `key` bucket".into()))?;
    let last = match reader.last_key(&key_bucket.root)? {
        Some(k) => main_revision(&k)?,
        None => 0,
    };
    let compacted = match buckets.iter().find(|b| b.name == META_BUCKET) {
        Some(meta) => match reader.get(&meta.root, FINISHED_COMPACT)? {
            Some(v) => main_revision(&v)?,
            None => 0,
        },
        None => 0,
    };
    // An etcd starts at revision 1 with no record of it: a snapshot of an empty etcd is at 1.
    Ok(last.max(compacted).max(1))
}

fn write_blocking(
    input: &Path,
    db_len: u64,
    out: &Path,
    mut rx: mpsc::Receiver<Batch>,
    plan: Plan,
    cancel: &CancellationToken,
) -> Result<Outcome, Fail> {
    // The snapshot is patched in place; until the patch commits, only what follows the
    // database (etcd's hash) is overwritten, and that is put back if the patch fails, so the
    // replay through etcd can still use the snapshot as fetched.
    let trailer = read_trailer(input, db_len)?;
    let patched = patch(input, db_len, &mut rx, plan, cancel);
    match patched {
        Ok(done) => {
            rename_or_copy(input, out).map_err(Fail::Io)?;
            Ok(done)
        }
        Err(e) => {
            restore_trailer(input, db_len, &trailer).map_err(Fail::Io)?;
            Err(e)
        }
    }
}

/// [`write_blocking`] with `events` as one delta already decoded: the fuzz target's way into
/// the patcher ([`crate::fuzzing::patch`]) without a store or a runtime.
pub(crate) fn write_events(
    input: &Path,
    db_len: u64,
    out: &Path,
    events: Vec<delta::TimedEvent>,
    plan: Plan,
) -> Result<Outcome, String> {
    let (tx, rx) = mpsc::channel(1);
    // The receiver is alive and the channel empty, so the one batch always fits.
    let _ = tx.try_send(Ok((
        "Incr-fuzz".to_owned(),
        delta::Events::from_events(events),
    )));
    drop(tx);
    write_blocking(input, db_len, out, rx, plan, &CancellationToken::new()).map_err(|e| match e {
        Fail::Deltas(e) | Fail::Unsupported(e) => e,
        Fail::Io(e) => e.to_string(),
        Fail::Aborted => "aborted".into(),
    })
}

/// What follows the database in the snapshot file (etcd's hash).
fn read_trailer(path: &Path, db_len: u64) -> Result<Vec<u8>, Fail> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(path).map_err(Fail::Io)?;
    file.seek(SeekFrom::Start(db_len)).map_err(Fail::Io)?;
    let mut trailer = Vec::new();
    file.take(1 << 10)
        .read_to_end(&mut trailer)
        .map_err(Fail::Io)?;
    Ok(trailer)
}

/// Cuts the snapshot file back to its database and puts `trailer` after it.
fn restore_trailer(path: &Path, db_len: u64, trailer: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new().write(true).open(path)?;
    file.set_len(db_len)?;
    file.write_all_at(trailer, db_len)
}

/// Moves the patched database to `out` (a copy when they are on different filesystems).
fn rename_or_copy(from: &Path, to: &Path) -> std::io::Result<()> {
    match std::fs::rename(from, to) {
        Err(e) if e.raw_os_error() == Some(nix::libc::EXDEV) => {
            std::fs::copy(from, to)?;
            std::fs::remove_file(from)
        }
        other => other,
    }
}

/// Patches the database in the first `db_len` bytes of `path` ([`Patcher`]): the
/// events appended to the `key` bucket, the membership and the revision bump written; the
/// buckets this does not change keep their pages.
fn patch(
    path: &Path,
    db_len: u64,
    rx: &mut mpsc::Receiver<Batch>,
    plan: Plan,
    cancel: &CancellationToken,
) -> Result<Outcome, Fail> {
    let reader = Reader::open(path, db_len)?.cancel_on(cancel.clone());
    let buckets = reader.buckets()?;
    let restored = database_revision(&reader, &buckets)?;
    if let Some(Target::Revision(r)) = plan.until
        && restored > r
    {
        return Err(Fail::Deltas(format!(
            "the full snapshot's database holds revisions up to {restored} (writes that raced \
             the snapshot), beyond the target revision {r}; choose a target at or after \
             {restored}, or one the previous full snapshot's deltas reach"
        )));
    }
    let membership = plan.membership.as_ref();
    let has_meta = buckets.iter().any(|b| b.name == META_BUCKET);
    if membership.is_some() && !has_meta {
        return Err(Fail::Unsupported(
            "no `meta` bucket to write the consistent index in".into(),
        ));
    }
    if plan.bump.mark_compacted && !has_meta {
        return Err(Fail::Unsupported(
            "no `meta` bucket to mark the compaction in".into(),
        ));
    }
    let mut cursor = Cursor::new(restored, plan.until);
    // The bump's revision, known once the key bucket is written (`meta` sorts after `key`).
    let mut bumped: Option<i64> = None;
    let mut writer = Patcher::open(path, &reader)?;
    let mut values = Vec::with_capacity(buckets.len() + 3);
    for bucket in with_membership_buckets(&buckets, membership) {
        let name = bucket.name.as_slice();
        let added = matches!(&bucket.root, Root::Inline(page) if page.is_empty());
        let members = membership.and_then(|m| m.members.as_ref());
        let root = if name == KEY_BUCKET {
            let (root, bump) =
                extend_key_bucket(&bucket, &mut writer, rx, &mut cursor, &plan, cancel)?;
            bumped = bump;
            root
        } else if added || (members.is_some() && (name == MEMBERS || name == MEMBERS_REMOVED)) {
            let mut tree = writer.replace(&bucket.root)?;
            if let Some(members) = members.filter(|_| name == MEMBERS) {
                for (k, v) in members {
                    tree.push(k, v)?;
                }
            }
            Some(tree.finish()?)
        } else if name == META_BUCKET && (membership.is_some() || plan.bump.mark_compacted) {
            let mut set: Vec<(Vec<u8>, Vec<u8>)> =
                membership.map(|m| m.meta.clone()).unwrap_or_default();
            if plan.bump.mark_compacted
                && let Some(b) = bumped
            {
                set.push((SCHEDULED_COMPACT.to_vec(), revision_key(b, 0, false)));
            }
            set.sort();
            let mut tree = writer.replace(&bucket.root)?;
            copy_bucket(&reader, &bucket, &mut tree, set)?;
            Some(tree.finish()?)
        } else {
            None
        };
        values.push(match root {
            Some(page) => Bucket {
                root: Root::Page(page),
                ..bucket
            },
            None => bucket,
        });
    }
    writer.commit(&values)?;
    tracing::debug!(
        restored,
        events = cursor.events,
        revision = cursor.revision,
        bumped,
        "deltas written into the database"
    );
    Ok(Outcome::Done {
        events: cursor.events,
        revision: cursor.revision,
        restored,
        etcd_revision: bumped.unwrap_or(cursor.revision),
        last_event_time: cursor.last_time,
    })
}

/// Appends the events to the `key` bucket, then the bump's record; returns the bucket's new
/// root page, `None` when nothing was added (the bucket keeps its pages), and the bump's
/// revision.
fn extend_key_bucket(
    bucket: &Bucket,
    writer: &mut Patcher<'_>,
    rx: &mut mpsc::Receiver<Batch>,
    cursor: &mut Cursor,
    plan: &Plan,
    cancel: &CancellationToken,
) -> Result<(Option<u64>, Option<i64>), Fail> {
    let mut tree = Lazy {
        writer: Some(writer),
        tree: None,
    };
    append_events(rx, cursor, cancel, &mut |k, v| {
        tree.get(&bucket.root)?.push(k, v)
    })?;
    let mut bumped = None;
    if plan.bump.by > 0 {
        let by = i64::try_from(plan.bump.by).unwrap_or(i64::MAX);
        let b = cursor.revision.checked_add(by).ok_or_else(|| {
            Fail::Deltas(format!(
                "a revision bump of {by} from revision {} overflows",
                cursor.revision
            ))
        })?;
        tree.get(&bucket.root)?
            .push(&revision_key(b, 0, false), &[])?;
        bumped = Some(b);
    }
    let root = match tree.tree {
        Some(t) => Some(t.finish()?),
        None => None,
    };
    Ok((root, bumped))
}

/// A tree extended on its first key: a bucket nothing is added to keeps its pages.
struct Lazy<'w, 'r> {
    writer: Option<&'w mut Patcher<'r>>,
    tree: Option<Tree<'w>>,
}

impl<'w> Lazy<'w, '_> {
    fn get(&mut self, root: &Root) -> Result<&mut Tree<'w>, BoltError> {
        if let Some(writer) = self.writer.take() {
            self.tree = Some(writer.extend(root)?);
        }
        Ok(self.tree.as_mut().expect("extended"))
    }
}

/// The buckets to write: the snapshot's, and when etcd 3.5's membership is written the three
/// its restore creates if missing (empty, sequence 0), by name.
fn with_membership_buckets(buckets: &[Bucket], membership: Option<&Membership>) -> Vec<Bucket> {
    let mut all = buckets.to_vec();
    if membership.is_some_and(|m| m.members.is_some()) {
        for name in [MEMBERS, MEMBERS_REMOVED, CLUSTER] {
            if !all.iter().any(|b| b.name == name) {
                all.push(Bucket {
                    name: name.to_vec(),
                    root: Root::Inline(Vec::new()),
                    sequence: 0,
                });
            }
        }
        all.sort_by(|a, b| a.name.cmp(&b.name));
    }
    all
}

/// Copies `bucket` into `tree` with the keys of `set` (ascending) set to their values.
fn copy_bucket(
    reader: &Reader,
    bucket: &Bucket,
    tree: &mut Tree<'_>,
    set: Vec<(Vec<u8>, Vec<u8>)>,
) -> Result<(), BoltError> {
    let mut pending = set.into_iter().peekable();
    if matches!(&bucket.root, Root::Inline(page) if page.is_empty()) {
        // A bucket this writer adds: nothing to copy.
        for (k, v) in pending {
            tree.push(&k, &v)?;
        }
        return Ok(());
    }
    reader.visit(&bucket.root, &mut |flags, k, v| {
        if flags != 0 {
            return Err(BoltError::Unsupported(format!(
                "a nested bucket in {:?}",
                String::from_utf8_lossy(&bucket.name)
            )));
        }
        // Keys arrive in order: a new value goes in before the first key after its own, or in
        // place of its own.
        let mut replaced = false;
        while let Some((key, value)) = pending.next_if(|(key, _)| key.as_slice() <= k) {
            tree.push(&key, &value)?;
            replaced |= key.as_slice() == k;
        }
        if replaced {
            return Ok(());
        }
        tree.push(k, v)
    })?;
    for (k, v) in pending {
        tree.push(&k, &v)?;
    }
    Ok(())
}

/// The revision etcd starts at on the database file at `path` (no hash after it).
pub fn file_revision(path: &Path) -> Result<i64, BoltError> {
    let len = std::fs::metadata(path)?.len();
    let reader = Reader::open(path, len)?;
    let buckets = reader.buckets()?;
    database_revision(&reader, &buckets)
}

/// Adds one record (key, value) to a tree.
type Push<'a> = dyn FnMut(&[u8], &[u8]) -> Result<(), BoltError> + 'a;

/// Appends every event the fetching side sends, up to the cursor's target; on reaching it the
/// channel is closed, which stops the fetching. A cancelled restore stops at the next batch, and
/// its closed queue is no end of the deltas.
fn append_events(
    rx: &mut mpsc::Receiver<Batch>,
    cursor: &mut Cursor,
    cancel: &CancellationToken,
    push: &mut Push<'_>,
) -> Result<(), Fail> {
    loop {
        let batch = rx.blocking_recv();
        if cancel.is_cancelled() {
            return Err(Fail::Aborted);
        }
        let Some(batch) = batch else {
            break;
        };
        let (name, events) = batch.map_err(|()| Fail::Aborted)?;
        for event in events.views() {
            if cursor.past_target(&event, event.time) {
                rx.close();
                return Ok(());
            }
            if let Some((k, v)) = cursor.record(&event, &name)? {
                push(&k, &v)?;
                cursor.last_time = Some(event.time);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::restore::bolt::NewFile;
    use crate::snapshot::delta::{Event, KeyValue};

    #[test]
    fn records_are_etcds_encoding() {
        assert_eq!(
            revision_key(0x0102, 3, false),
            [0, 0, 0, 0, 0, 0, 1, 2, b'_', 0, 0, 0, 0, 0, 0, 0, 3]
        );
        assert_eq!(revision_key(5, 0, true).last(), Some(&b't'));
        // mvccpb.KeyValue{Key: "k", CreateRevision: 2, ModRevision: 300, Version: 1, Value: "v"}
        assert_eq!(
            encode_kv(b"k", 2, 300, 1, b"v"),
            [
                0x0a, 1, b'k', 0x10, 2, 0x18, 0xac, 0x02, 0x20, 1, 0x2a, 1, b'v'
            ]
        );
        // A tombstone's value carries only the key.
        assert_eq!(encode_kv(b"k", 0, 0, 0, b""), [0x0a, 1, b'k']);
        // Decoding gives the fields back; a lease (field 6) is skipped.
        let mut with_lease = encode_kv(b"key", 7, 1 << 40, 3, b"value");
        with_lease.extend_from_slice(&[0x30, 0x05]);
        assert_eq!(
            decode_kv(&with_lease).unwrap(),
            DecodedKv {
                key: b"key".to_vec(),
                create_revision: 7,
                mod_revision: 1 << 40,
                version: 3,
                value: b"value".to_vec(),
            }
        );
        assert!(decode_kv(&[0x0a, 5, b'k']).is_err(), "a truncated key");
        assert_eq!(main_revision(&revision_key(77, 9, true)).unwrap(), 77);
    }

    fn put(key: &str, create: i64, rev: i64, version: i64) -> Event {
        Event {
            kind: EventType::Put,
            kv: Some(KeyValue {
                key: key.as_bytes().to_vec(),
                create_revision: create,
                mod_revision: rev,
                version,
                value: b"v".to_vec(),
                lease: 0,
            }),
            prev_kv: None,
        }
    }

    fn delete(key: &str, rev: i64) -> Event {
        Event {
            kind: EventType::Delete,
            kv: Some(KeyValue {
                key: key.as_bytes().to_vec(),
                mod_revision: rev,
                ..KeyValue::default()
            }),
            prev_kv: None,
        }
    }

    fn cursor(restored: i64) -> Cursor {
        Cursor::new(restored, None)
    }

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(secs, 0).unwrap()
    }

    #[test]
    fn a_target_stops_at_the_first_event_of_a_later_revision_never_inside_one() {
        let mut by_rev = Cursor::new(10, Some(Target::Revision(12)));
        let mut by_time = Cursor::new(10, Some(Target::Time(at(100))));
        // (event, received at, past the revision target, past the time target)
        let steps = [
            (put("a", 9, 10, 2), 150, false, false), // in the snapshot: never past
            (put("a", 9, 11, 3), 90, false, false),
            (put("b", 12, 12, 1), 100, false, false),
            (delete("a", 12), 130, false, false), // the rest of revision 12
            (put("c", 13, 13, 1), 101, true, true),
        ];
        for (i, (event, t, rev_past, time_past)) in steps.iter().enumerate() {
            assert_eq!(
                by_rev.past_target(&event.view_at(at(*t)), at(*t)),
                *rev_past,
                "revision, step {i}"
            );
            assert_eq!(
                by_time.past_target(&event.view_at(at(*t)), at(*t)),
                *time_past,
                "time, step {i}"
            );
            for c in [&mut by_rev, &mut by_time] {
                if !*rev_past {
                    c.record(&event.view_at(at(*t)), "d").ok().unwrap();
                }
            }
        }
        assert_eq!((by_rev.revision, by_time.revision), (12, 12));
        // No target: nothing is ever past it.
        assert!(
            !Cursor::new(10, None)
                .past_target(&put("z", 99, 99, 1).view_at(at(0)), at(4_000_000_000),)
        );
    }

    /// A snapshot file in `dir`: a database of revisions 1 to `revisions` (one put each) and a
    /// `meta` bucket, then 32 bytes standing for etcd's hash. Returns its path, the database's
    /// length and the whole file.
    fn snapshot_file(dir: &Path, revisions: i64) -> (std::path::PathBuf, u64, Vec<u8>) {
        let path = dir.join("snapshot.db");
        let mut w = NewFile::create(&path, 4096).unwrap();
        let mut key = w.tree();
        for rev in 1..=revisions {
            let k = format!("k{rev}");
            key.push(
                &revision_key(rev, 0, false),
                &encode_kv(k.as_bytes(), rev, rev, 1, &[b'v'; 300]),
            )
            .unwrap();
        }
        let key = key.finish().unwrap();
        let mut meta = w.tree();
        meta.push(b"consistent_index", &[0; 8]).unwrap();
        let meta = meta.finish().unwrap();
        w.finish(
            &[Bucket::paged(b"key", key), Bucket::paged(b"meta", meta)],
            3,
        )
        .unwrap();
        let db_len = std::fs::metadata(&path).unwrap().len();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.extend_from_slice(&[0xAB; 32]);
        std::fs::write(&path, &bytes).unwrap();
        (path, db_len, bytes)
    }

    fn timed(events: Vec<Event>) -> Vec<delta::TimedEvent> {
        events
            .into_iter()
            .map(|event| delta::TimedEvent { event, time: at(1) })
            .collect()
    }

    /// Runs the patch of `snapshot` with `events` in one delta.
    fn patched(
        snapshot: &Path,
        db_len: u64,
        out: &Path,
        events: Vec<Event>,
        plan: Plan,
    ) -> Result<Outcome, Fail> {
        let (tx, rx) = mpsc::channel(1);
        tx.try_send(Ok((
            "Incr-1".to_owned(),
            delta::Events::from_events(timed(events)),
        )))
        .unwrap();
        drop(tx);
        write_blocking(snapshot, db_len, out, rx, plan, &CancellationToken::new())
    }

    /// A restore dropped while the writer waits for deltas (SIGTERM stops a one-shot command by
    /// dropping it): its closed queue looked like the end of the deltas, so the writer committed
    /// the patch and moved the database; a writer busy reading went on until it had read
    /// everything, and the process waited for it. It stops, and leaves the snapshot as fetched.
    #[test]
    fn a_dropped_feed_stops_the_writer_and_commits_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (snapshot, db_len, fetched) = snapshot_file(dir.path(), 2000);
        let out = dir.path().join("db");
        let (tx, rx) = mpsc::channel(1);
        let cancel = CancellationToken::new();
        let feed = Feed {
            tx,
            cancel: cancel.clone(),
            finished: false,
        };
        feed.tx
            .try_send(Ok((
                "Incr-1".to_owned(),
                delta::Events::from_events(timed(vec![put("k", 1, 2001, 1)])),
            )))
            .unwrap();
        let writer = std::thread::spawn(move || {
            write_blocking(&snapshot, db_len, &out, rx, Plan::default(), &cancel)
        });
        drop(feed);
        let written = writer.join().unwrap();
        assert!(matches!(written, Err(Fail::Aborted)), "the writer went on");
        let (snapshot, out) = (dir.path().join("snapshot.db"), dir.path().join("db"));
        assert!(!out.exists());
        assert!(std::fs::read(&snapshot).unwrap() == fetched);
    }

    #[test]
    fn a_patch_that_cannot_finish_leaves_the_snapshot_as_fetched() {
        let dir = tempfile::tempdir().unwrap();
        let (snapshot, db_len, fetched) = snapshot_file(dir.path(), 2000);
        let out = dir.path().join("db");
        // Many records written into new pages (past the database, over the hash), then a put
        // etcd's records cannot carry: the replay through etcd needs the snapshot back.
        let mut events: Vec<Event> = (2001..3000).map(|r| put("k", 1, r, r - 1999)).collect();
        events.push(put("bad", 0, 3000, 0));
        let plan = Plan {
            membership: Some(Membership {
                members: Some(vec![(b"1".to_vec(), b"{}".to_vec())]),
                meta: vec![(b"term".to_vec(), vec![0; 8])],
            }),
            ..Plan::default()
        };
        match patched(&snapshot, db_len, &out, events, plan) {
            Err(Fail::Unsupported(reason)) => {
                assert!(reason.contains("create revision"), "{reason}")
            }
            _ => panic!("an unsupported put must end the patch"),
        }
        assert!(
            std::fs::read(&snapshot).unwrap() == fetched,
            "the snapshot is back as fetched"
        );
        assert!(!out.exists());
    }

    #[test]
    fn a_patched_snapshot_is_consistent_and_moved_to_the_member_directory() {
        let dir = tempfile::tempdir().unwrap();
        let (snapshot, db_len, _) = snapshot_file(dir.path(), 2000);
        let out = dir.path().join("db");
        let events: Vec<Event> = (2001..=4000)
            .map(|r| put(&format!("k{r}"), r, r, 1))
            .collect();
        let plan = Plan {
            bump: RevisionBump {
                by: 1000,
                mark_compacted: true,
            },
            membership: Some(Membership {
                members: Some(vec![(b"1".to_vec(), b"{}".to_vec())]),
                meta: vec![(b"term".to_vec(), vec![0; 8])],
            }),
            ..Plan::default()
        };
        let outcome = patched(&snapshot, db_len, &out, events, plan).ok().unwrap();
        assert!(matches!(
            outcome,
            Outcome::Done {
                events: 2000,
                revision: 4000,
                restored: 2000,
                etcd_revision: 5000,
                ..
            }
        ));
        assert!(!snapshot.exists());
        let len = std::fs::metadata(&out).unwrap().len();
        let reader = Reader::open(&out, len).unwrap();
        reader.check().unwrap();
        assert_eq!(reader.txid(), 4);
        let buckets = reader.buckets().unwrap();
        let names: Vec<&[u8]> = buckets.iter().map(|b| b.name.as_slice()).collect();
        assert_eq!(
            names,
            [
                &b"cluster"[..],
                b"key",
                b"members",
                b"members_removed",
                b"meta"
            ]
        );
        assert_eq!(database_revision(&reader, &buckets).unwrap(), 5000);
        let mut revisions = Vec::new();
        reader
            .visit(&buckets[1].root, &mut |_, k, _| {
                revisions.push(main_revision(k)?);
                Ok(())
            })
            .unwrap();
        let expected: Vec<i64> = (1..=4000).chain([5000]).collect();
        assert_eq!(revisions, expected);
        let meta = &buckets[4].root;
        assert_eq!(
            reader.get(meta, SCHEDULED_COMPACT).unwrap(),
            Some(revision_key(5000, 0, false))
        );
        assert_eq!(reader.get(meta, b"term").unwrap(), Some(vec![0; 8]));
        assert_eq!(
            reader.get(meta, b"consistent_index").unwrap(),
            Some(vec![0; 8])
        );
    }

    #[test]
    fn events_continue_the_snapshot_one_revision_at_a_time() {
        let mut c = cursor(10);
        // Already in the snapshot.
        assert!(
            c.record(&put("a", 9, 10, 2).view_at(at(0)), "d")
                .ok()
                .unwrap()
                .is_none()
        );
        let (k, _) = c
            .record(&put("a", 9, 11, 3).view_at(at(0)), "d")
            .ok()
            .unwrap()
            .unwrap();
        assert_eq!(k, revision_key(11, 0, false));
        // Two events of one transaction: sub-revisions 0 and 1.
        let (k, _) = c
            .record(&put("b", 12, 12, 1).view_at(at(0)), "d")
            .ok()
            .unwrap()
            .unwrap();
        assert_eq!(k, revision_key(12, 0, false));
        let (k, v) = c
            .record(&delete("a", 12).view_at(at(0)), "d")
            .ok()
            .unwrap()
            .unwrap();
        assert_eq!(
            (k, v),
            (revision_key(12, 1, true), encode_kv(b"a", 0, 0, 0, b""))
        );
        assert_eq!((c.events, c.revision), (3, 12));
        // A gap is a lost delta, going back a broken chain.
        match c.record(&put("c", 14, 14, 1).view_at(at(0)), "Incr-x") {
            Err(Fail::Deltas(e)) => assert!(e.contains("13 to 13 are missing"), "{e}"),
            _ => panic!("a gap must fail"),
        }
        match c.record(&put("c", 11, 11, 1).view_at(at(0)), "Incr-x") {
            Err(Fail::Deltas(e)) => assert!(e.contains("out of order"), "{e}"),
            _ => panic!("going back must fail"),
        }
        // A put without what etcd stores for it cannot be written directly.
        assert!(matches!(
            c.record(&put("c", 0, 13, 0).view_at(at(0)), "d"),
            Err(Fail::Unsupported(_))
        ));
    }
}
