//! The copy job: wait for the source's final snapshot, then copy snapshots between stores.
//!
//! - **Waiting** (`wait_for_final`): the source store is listed every `poll_interval` until it
//!   holds the hand-off's final snapshot ([`crate::owner::handoff::the_final`], the function every
//!   reader uses: the one etcd-warden's hand-off record or intent names, never a final
//!   `etcd-warden reclaim` marked reclaimed; only for a store without any etcd-warden object,
//!   i.e. of the reference tool, its newest snapshot when that is a final full one), or
//!   `final_timeout` passes. On timeout the job logs an error and copies what is
//!   there, as seed 001 says, so the destination is not left without data; writes the source
//!   acknowledged after its newest snapshot are then not in the copy, and the log says so.
//! - **Selection**: [`plan::select`] (all, newest N full snapshots, younger than an age; the
//!   final snapshot and its deltas always). Objects of the source whose names are not snapshot
//!   names are named in a warning and the report, and not copied.
//! - **Gaps**: when the deltas after the newest selected full snapshot have a revision gap
//!   ([`layout::first_gap`], the rule `restore` applies), every selected snapshot is still
//!   copied (the destination loses nothing the source has), then the job fails naming the gap:
//!   a destination whose restore would fail must not be reported as done.
//! - **Streaming**: each object flows from the source's GET into the destination's upload; a tee
//!   feeds the same bytes to a decoder that checks the payload's trailing SHA-256 (etcd's for a
//!   full snapshot, the writer's for a delta) and holds the last chunk back until the check has
//!   passed. The listing gives every object's size, so on S3 an object up to 1 GiB goes in one
//!   streamed `PUT` with that `Content-Length` ([`crate::store::SinglePut`]; S3 keeps nothing
//!   of a request whose body falls short), larger ones and other backends in a multipart upload
//!   completed only after the check. Either way a corrupt source object leaves nothing at the
//!   destination, and memory per object is a few chunks, never the object.
//! - **Idempotence**: an object already at the destination under the same name (ignoring
//!   `.final`) with the same size is skipped, so a retried Job uploads nothing twice.
//! - **`.final` is stripped at the destination** ([`plan::dest_name`]): the destination's own
//!   sidecar takes "my latest full snapshot is final" to mean it already took its final
//!   snapshot, and must not believe that about itself because of a copy.
//! - **Same bucket**: when source and destination are the same bucket (different prefixes), the
//!   payload is verified by reading it and then copied server side, so it is not uploaded again.

pub mod plan;
pub mod progress;
pub mod secondary;

use std::collections::HashMap;
use std::io;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use object_store::ObjectStoreExt as _;
use tokio::sync::mpsc;
use tracing::Instrument as _;

use crate::config::StoreLocation;
use crate::config::{Config, CopyConfig, ProcessEnv, StoreConfig};
use crate::snapshot::full::verify_sha256;
use crate::store::compression::ByteStream;
use crate::store::{Codec, Oversized, Snapshot, SnapshotStore, StoreError, encryption, layout};

pub use plan::{Listed, Selection};
use progress::{Bar, Progress};

/// How often progress is logged.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);
/// How often the progress bar is redrawn (stderr a terminal only).
const BAR_EVERY: Duration = Duration::from_millis(250);
/// Chunks the hash check may lag behind the upload.
const TEE_DEPTH: usize = 16;

/// Copy job errors.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    /// No `[source_store]` is configured.
    #[error("no source store: give --source-store URL or [source_store] url")]
    NoSource,
    /// A store could not be built or listed.
    #[error("{which} store {url}: {source}")]
    Store {
        /// "source" or "destination".
        which: &'static str,
        /// The store's URL (or prefix, once built).
        url: String,
        /// What failed.
        #[source]
        source: StoreError,
    },
    /// Some selected snapshots are not at the destination.
    #[error(
        "{} of {total} selected snapshots not copied: {}",
        failures.len(),
        failures.iter().map(|(n, e)| format!("{n}: {e}")).collect::<Vec<_>>().join("; ")
    )]
    Incomplete {
        /// Snapshots selected.
        total: usize,
        /// Each failed snapshot's source name and why.
        failures: Vec<(String, ObjectError)>,
    },
    /// Every selected snapshot is at the destination, but the latest chain among them has a
    /// revision gap: a restore there fails, so the job does not report success.
    #[error(
        "every selected snapshot is at the destination ({copied} copied now, {skipped} already \
         there), but the destination cannot be restored: {gap}"
    )]
    Unrestorable {
        /// Snapshots copied now.
        copied: usize,
        /// Snapshots already at the destination.
        skipped: usize,
        /// Where the chain breaks.
        gap: layout::Gap,
    },
}

/// Why one snapshot was not copied; nothing is stored for it at the destination.
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    /// The source object could not be opened.
    #[error("cannot read: {0}")]
    Read(StoreError),
    /// The payload failed its hash check, or reading it failed on the way.
    #[error("source object is corrupt or unreadable: {0}")]
    Corrupt(io::Error),
    /// The destination refused the server-side copy.
    #[error("server-side copy failed: {0}")]
    ServerSideCopy(object_store::Error),
    /// The upload to the destination failed.
    #[error("upload failed: {0}")]
    Upload(StoreError),
}

/// What a successful copy did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Snapshots selected in the source.
    pub selected: usize,
    /// Copied now.
    pub copied: usize,
    /// Already at the destination.
    pub skipped: usize,
    /// Bytes copied now.
    pub bytes: u64,
    /// The final snapshot found in the source, if any.
    pub final_snapshot: Option<String>,
    /// Objects in the source whose names are not snapshot names (not copied).
    pub unrecognised: Vec<String>,
}

/// The two stores of a copy.
#[derive(Debug, Clone)]
pub struct Stores {
    /// Read from.
    pub source: SnapshotStore,
    /// Written to.
    pub dest: SnapshotStore,
    /// Source and destination share one bucket: copy server side.
    pub server_side: bool,
}

impl Stores {
    /// Builds both stores: the source from `[source_store]` with `SOURCE_`-prefixed provider
    /// variables, the destination from `[store]`.
    pub fn from_config(source: &StoreConfig, dest: &StoreConfig) -> Result<Stores, CopyError> {
        Stores::build(source, Some("SOURCE_"), dest, None)
    }

    /// Builds both stores, each with its own prefix of provider variables.
    pub fn build(
        source: &StoreConfig,
        source_env: Option<&str>,
        dest: &StoreConfig,
        dest_env: Option<&str>,
    ) -> Result<Stores, CopyError> {
        let fail = |which, cfg: &StoreConfig| {
            let url = cfg.location.to_string();
            move |source| CopyError::Store { which, url, source }
        };
        let dest_backend = crate::store::build_with_env(dest, &ProcessEnv, dest_env)
            .map_err(fail("destination", dest))?;
        let server_side = same_bucket(source, dest);
        // In one bucket the destination's client reads both prefixes, so a server-side copy is
        // one request signed by one set of credentials.
        let source_backend = if server_side {
            dest_backend.clone()
        } else {
            crate::store::build_with_env(source, &ProcessEnv, source_env)
                .map_err(fail("source", source))?
        };
        let single_put = crate::store::single_put_with_env(dest, &ProcessEnv, dest_env)
            .map_err(fail("destination", dest))?;
        let object_lock = crate::store::object_lock_with_env(dest, &ProcessEnv, dest_env)
            .map_err(fail("destination", dest))?;
        // Listings that meet a key which is no object key go on page by page, with the
        // credentials of the client that reads each store.
        let (pager_cfg, pager_env) = match server_side {
            true => (dest, dest_env),
            false => (source, source_env),
        };
        let source_pager = crate::store::pager_with_env(pager_cfg, &ProcessEnv, pager_env)
            .map_err(fail("source", source))?;
        let dest_pager = crate::store::pager_with_env(dest, &ProcessEnv, dest_env)
            .map_err(fail("destination", dest))?;
        Ok(Stores {
            source: SnapshotStore::at(source_backend, &source.location).with_pager(source_pager),
            dest: SnapshotStore::at(dest_backend, &dest.location)
                .with_single_put(single_put)
                .with_object_lock(object_lock)
                .with_pager(dest_pager),
            server_side,
        })
    }
}

/// Whether two stores are one bucket of one service (so objects can be copied server side).
/// Stores encrypted otherwise (SSE keys) are not: one client cannot read with one customer key
/// and write with another.
pub fn same_bucket(a: &StoreConfig, b: &StoreConfig) -> bool {
    let same_service = a.endpoint == b.endpoint && a.sse == b.sse;
    match (&a.location, &b.location) {
        (StoreLocation::S3 { bucket: x, .. }, StoreLocation::S3 { bucket: y, .. })
        | (StoreLocation::Gcs { bucket: x, .. }, StoreLocation::Gcs { bucket: y, .. }) => {
            x == y && same_service
        }
        (StoreLocation::Azure { container: x, .. }, StoreLocation::Azure { container: y, .. }) => {
            x == y && same_service && a.account_name == b.account_name
        }
        _ => false,
    }
}

/// Runs the copy job from the validated configuration (`[source_store]` → `[store]`).
pub async fn run_from_config(config: &Config) -> Result<Report, CopyError> {
    let Some(source) = &config.source_store else {
        return Err(CopyError::NoSource);
    };
    let mut stores = Stores::from_config(source, &config.store)?;
    stores.source = stores.source.with_read_limits(config.restore.read_limits);
    run(&stores, &config.copy).await
}

/// Waits for the final snapshot if asked, then copies the selected snapshots. `Ok` only when
/// every selected snapshot is at the destination.
#[tracing::instrument(
    name = "copy",
    skip_all,
    fields(source = %stores.source.prefix(), dest = %stores.dest.prefix())
)]
pub async fn run(stores: &Stores, config: &CopyConfig) -> Result<Report, CopyError> {
    let final_snapshot = if config.wait_for_final {
        let wait = Wait {
            timeout: config.final_timeout,
            poll: config.poll_interval,
            druid_final: config.druid_final,
        };
        wait_for_final(&stores.source, wait).await
    } else {
        None
    };

    let listing = stores
        .source
        .listing()
        .await
        .map_err(store_error("source", &stores.source))?;
    let unrecognised: Vec<String> = listing
        .unrecognised
        .iter()
        .map(|u| u.name.clone())
        .collect();
    if !unrecognised.is_empty() {
        // A damaged name may be a snapshot the destination needed.
        tracing::warn!(
            objects = %unrecognised.join(", "),
            "objects in the source whose names are not snapshot names are not copied"
        );
    }
    let listed: Vec<Listed> = listing
        .snapshots
        .into_iter()
        .map(|(snapshot, size)| Listed { snapshot, size })
        .collect();
    let snapshots: Vec<Snapshot> = listed.iter().map(|l| l.snapshot.clone()).collect();
    let selection = Selection {
        max_backups: config.max_backups,
        max_age: config.max_age,
    };
    let chosen = plan::select(&snapshots, selection, chrono::Utc::now());
    let sizes: HashMap<&str, u64> = listed
        .iter()
        .map(|l| (l.snapshot.snap_name.as_str(), l.size))
        .collect();
    let selected: Vec<Listed> = chosen
        .into_iter()
        .map(|s| Listed {
            size: sizes.get(s.snap_name.as_str()).copied().unwrap_or(0),
            snapshot: s,
        })
        .collect();
    let total = selected.len();
    let chosen: Vec<Snapshot> = selected.iter().map(|l| l.snapshot.clone()).collect();
    let gap = layout::first_gap(&layout::latest_chain(&chosen));
    if let Some(gap) = &gap {
        tracing::error!(
            %gap,
            "copying every selected snapshot anyway, then failing: the destination's latest \
             chain would not restore"
        );
    }

    let at_dest: HashMap<String, u64> = list_sized(&stores.dest)
        .await
        .map_err(store_error("destination", &stores.dest))?
        .into_iter()
        .map(|l| (l.snapshot.snap_name, l.size))
        .collect();
    let (mut todo, skipped) = plan::pending(selected, &at_dest);
    // Largest first: the long copies start at once and the small ones fill in around them, so
    // the job does not end waiting on one big object started last.
    todo.sort_by_key(|l| std::cmp::Reverse(l.size));
    let progress = Progress::new(todo.len(), todo.iter().map(|l| l.size).sum());
    tracing::info!(
        available = listed.len(),
        selected = total,
        to_copy = todo.len(),
        already_there = skipped.len(),
        bytes = progress.total_bytes,
        parallel = config.parallel,
        server_side = stores.server_side,
        "copy starting"
    );

    let work = futures::stream::iter(todo)
        .map(|item| {
            let progress = &progress;
            let span = object_span(&item);
            let inside = span.clone();
            async move {
                let result = copy_one(stores, &item, progress).await;
                if result.is_ok() {
                    progress.objects.fetch_add(1, Ordering::Relaxed);
                }
                (span, item, result)
            }
            .instrument(inside)
        })
        .buffer_unordered(config.parallel.max(1))
        .collect::<Vec<_>>();
    tokio::pin!(work);
    let mut tick = tokio::time::interval(PROGRESS_EVERY);
    tick.tick().await;
    let mut bar = Bar::for_stderr();
    let mut redraw = tokio::time::interval(BAR_EVERY);
    // A slow redraw is skipped, not caught up in a burst.
    redraw.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let results = loop {
        tokio::select! {
            r = &mut work => break r,
            _ = tick.tick() => {
                if let Some(bar) = &mut bar {
                    bar.clear();
                }
                progress.log();
            }
            _ = redraw.tick(), if bar.is_some() => {
                if let Some(bar) = &mut bar {
                    bar.draw(&progress.counts());
                }
            }
        }
    };
    // Cleared before the last progress line and the per-snapshot errors below.
    drop(bar);
    progress.log();

    let mut failures = Vec::new();
    let mut copied = 0;
    for (span, item, result) in results {
        match result {
            Ok(_) => copied += 1,
            Err(e) => {
                span.in_scope(|| tracing::error!(error = %e, "copy failed; nothing stored for it"));
                failures.push((item.snapshot.snap_name.clone(), e));
            }
        }
    }
    if !failures.is_empty() {
        failures.sort_by(|a, b| a.0.cmp(&b.0));
        return Err(CopyError::Incomplete { total, failures });
    }
    if let Some(gap) = gap {
        return Err(CopyError::Unrestorable {
            copied,
            skipped: skipped.len(),
            gap,
        });
    }
    let report = Report {
        selected: total,
        copied,
        skipped: skipped.len(),
        bytes: progress.bytes.load(Ordering::Relaxed),
        final_snapshot: final_snapshot.map(|s| s.snap_name),
        unrecognised,
    };
    tracing::info!(
        selected = report.selected,
        copied = report.copied,
        skipped = report.skipped,
        bytes = report.bytes,
        "copy complete: every selected snapshot is at the destination"
    );
    Ok(report)
}

/// The span of one object's copy, with what an operator greps for.
fn object_span(item: &Listed) -> tracing::Span {
    let s = &item.snapshot;
    tracing::info_span!(
        "copy_object",
        snapshot = %s.snap_name,
        kind = %s.kind,
        revision = s.last_revision,
        size = item.size
    )
}

fn store_error(which: &'static str, store: &SnapshotStore) -> impl FnOnce(StoreError) -> CopyError {
    let url = store.prefix().to_string();
    move |source| CopyError::Store { which, url, source }
}

/// How [`wait_for_final`] waits.
#[derive(Debug, Clone, Copy)]
pub struct Wait {
    /// How long before copying anyway.
    pub timeout: Duration,
    /// How often the source is listed.
    pub poll: Duration,
    /// Whether etcd-druid's requested final also ends the wait ([`CopyConfig::druid_final`]).
    pub druid_final: bool,
}

/// Polls until the source holds the hand-off's final ([`crate::owner::handoff::the_final`]),
/// or with `druid_final` its newest snapshot is etcd-druid's requested final
/// ([`druids_final`]), or the timeout passes. Listing errors are logged and polled through: the
/// source store being briefly unreachable is no reason to give up the wait early.
pub async fn wait_for_final(source: &SnapshotStore, wait: Wait) -> Option<Snapshot> {
    let Wait {
        timeout,
        poll,
        druid_final,
    } = wait;
    let started = Instant::now();
    tracing::info!(
        timeout_seconds = timeout.as_secs_f64(),
        "waiting for the source's final snapshot"
    );
    let hand_off = crate::owner::handoff::HandOffObjects::new(source.clone());
    loop {
        let listed = async {
            let seen = hand_off.seen().await?;
            let requested = if druid_final {
                crate::store::gc::requested_finals(source).await?
            } else {
                Default::default()
            };
            let list = source.list().await?;
            Ok::<_, crate::owner::handoff::HandOffError>((list, seen, requested))
        };
        match listed.await {
            Ok((list, seen, requested)) => {
                let found = crate::owner::handoff::the_final(&list, &seen)
                    .or_else(|| druids_final(&list, &requested));
                if let Some(f) = found {
                    tracing::info!(
                        snapshot = %f.snap_name,
                        revision = f.last_revision,
                        waited_seconds = started.elapsed().as_secs_f64(),
                        "final snapshot found"
                    );
                    return Some(f.clone());
                }
            }
            Err(e) => tracing::warn!(error = %e, "listing the source failed; still waiting"),
        }
        let left = timeout.saturating_sub(started.elapsed());
        if left.is_zero() {
            tracing::error!(
                waited_seconds = started.elapsed().as_secs_f64(),
                "NO FINAL SNAPSHOT in the source within the timeout; copying the snapshots there \
                 are. Writes the source acknowledged after its newest snapshot are NOT in this \
                 copy: the source may not be fenced yet (see its sidecars' /status), could not \
                 store its final snapshot, or its last hand-off was undone by etcd-warden \
                 reclaim (a reclaimed final never counts)"
            );
            return None;
        }
        tokio::time::sleep(poll.min(left)).await;
    }
}

/// How many of the source's newest full snapshots etcd-backup-restore's copy looks at for a
/// final one.
const DRUID_FINAL_AMONG: usize = 4;

/// etcd-druid's requested final when it is among the newest [`DRUID_FINAL_AMONG`] full
/// snapshots of `sorted` (the newest such): what etcd-backup-restore's copy waits for. A
/// requested final older than that is an earlier request's, not this wait's. `requested` names
/// the requested finals ([`crate::store::gc::requested_finals`]).
pub fn druids_final<'a>(
    sorted: &'a [Snapshot],
    requested: &std::collections::HashSet<String>,
) -> Option<&'a Snapshot> {
    sorted
        .iter()
        .rev()
        .filter(|s| s.is_full())
        .take(DRUID_FINAL_AMONG)
        .find(|s| s.is_final && requested.contains(&s.snap_name))
}

/// Every snapshot in a store with its stored size, sorted.
pub async fn list_sized(store: &SnapshotStore) -> Result<Vec<Listed>, StoreError> {
    let listed = store.list_sized().await?;
    Ok(listed
        .into_iter()
        .map(|(snapshot, size)| Listed { snapshot, size })
        .collect())
}

/// Copies one snapshot, verified, under its destination name. Returns the bytes stored.
async fn copy_one(stores: &Stores, item: &Listed, progress: &Progress) -> Result<u64, ObjectError> {
    let source = &item.snapshot;
    let target = plan::dest_snapshot(source);
    let raw = stores
        .source
        .get_stream(source)
        .await
        .map_err(ObjectError::Read)?;
    let bytes = progress.bytes.clone();
    let counted = raw
        .inspect(move |chunk| {
            if let Ok(b) = chunk {
                bytes.fetch_add(b.len() as u64, Ordering::Relaxed);
            }
        })
        .boxed();
    let checked = if source.encrypted {
        verified_encrypted(counted)
    } else {
        verified_within(
            counted,
            source.compression,
            stores.source.bound_of(source, item.size),
        )
    };
    if stores.server_side {
        let mut checked = checked;
        while let Some(chunk) = checked.next().await {
            chunk.map_err(ObjectError::Corrupt)?;
        }
        let from = stores.source.path_of(source);
        let to = stores.dest.path_of(&target);
        stores
            .dest
            .backend()
            .copy(&from, &to)
            .await
            .map_err(ObjectError::ServerSideCopy)?;
        stores
            .dest
            .retain(&target)
            .await
            .map_err(ObjectError::Upload)?;
        return Ok(item.size);
    }
    let written = stores
        .dest
        .put_stream_sized(&target, checked, item.size)
        .await
        .map_err(|e| match e {
            StoreError::Payload(e) => ObjectError::Corrupt(e),
            other => ObjectError::Upload(other),
        })?;
    if written != item.size {
        tracing::warn!(
            listed = item.size,
            written,
            "the source object changed size while it was copied"
        );
    }
    tracing::debug!(bytes = written, "copied");
    Ok(written)
}

/// Passes a stored payload through unchanged while a decoder checks its trailing SHA-256 on the
/// side. The last chunk is held back until the check has passed: when it fails, the stream ends
/// with an error in that chunk's place, so an upload fed by it never receives the whole object
/// (a multipart upload is aborted, a single `PUT` falls short of its length and is discarded).
pub fn verified(input: ByteStream, codec: Codec) -> ByteStream {
    verified_by(input, move |side| verify_sha256(codec.decode(side)))
}

/// [`verified`], its decoder stopped at `bound`: a payload that decompresses beyond it (a
/// decompression bomb) fails as a corrupt one does, having cost no more than `bound`.
pub fn verified_within(input: ByteStream, codec: Codec, bound: Oversized) -> ByteStream {
    let limit = bound.limit;
    verified_by(input, move |side| {
        verify_sha256(crate::store::compression::bounded(
            codec.decode(side),
            limit,
            move || bound.clone().into_io(),
        ))
    })
}

/// [`verified`] for an encrypted payload, copied as ciphertext without a key: only its start is
/// checked (an age header). Its contents are authenticated when it is read with an identity
/// (`verify`, `restore`), which fail on any altered or truncated byte.
pub fn verified_encrypted(input: ByteStream) -> ByteStream {
    verified_by(input, |side| {
        let magic = encryption::AGE_MAGIC;
        futures::stream::unfold(
            (side, Vec::with_capacity(magic.len()), false),
            move |(mut side, mut head, done)| async move {
                if done {
                    return None;
                }
                let not_age = || {
                    io::Error::new(
                        io::ErrorKind::InvalidData,
                        "named as encrypted (.age) but not an age file",
                    )
                };
                match side.next().await {
                    Some(Ok(chunk)) => {
                        let take = chunk.len().min(magic.len() - head.len());
                        head.extend_from_slice(&chunk[..take]);
                        if !magic.starts_with(&head) {
                            return Some((Err(not_age()), (side, head, true)));
                        }
                        Some((Ok(chunk), (side, head, false)))
                    }
                    Some(Err(e)) => Some((Err(e), (side, head, true))),
                    None if head.len() < magic.len() => Some((Err(not_age()), (side, head, true))),
                    None => None,
                }
            },
        )
        .boxed()
    })
}

/// Passes `input` through while `check` consumes a copy: see [`verified`].
fn verified_by(input: ByteStream, check: impl FnOnce(ByteStream) -> ByteStream) -> ByteStream {
    let (tx, rx) = mpsc::channel::<io::Result<Bytes>>(TEE_DEPTH);
    let side = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
    .boxed();
    let mut checked = check(side);
    let check = tokio::spawn(async move {
        while let Some(chunk) = checked.next().await {
            chunk?;
        }
        Ok::<(), io::Error>(())
    });

    struct Tee {
        input: ByteStream,
        tx: Option<mpsc::Sender<io::Result<Bytes>>>,
        check: Option<tokio::task::JoinHandle<io::Result<()>>>,
        /// The latest chunk, passed on when the next one arrives or the check has passed.
        held: Option<Bytes>,
    }
    impl Tee {
        /// The check's verdict once its input is closed.
        async fn verdict(&mut self) -> io::Result<()> {
            self.tx = None;
            match self.check.take() {
                Some(task) => task.await.unwrap_or_else(|e| Err(io::Error::other(e))),
                None => Ok(()),
            }
        }

        /// The next item downstream; `None` at the end or after an error.
        async fn next(&mut self) -> Option<io::Result<Bytes>> {
            self.check.as_ref()?;
            loop {
                match self.input.next().await {
                    Some(Ok(chunk)) => {
                        let sent = match &self.tx {
                            Some(tx) => tx.send(Ok(chunk.clone())).await.is_ok(),
                            None => true,
                        };
                        if !sent {
                            // The check stopped reading early: the payload failed to decode.
                            self.held = None;
                            return Some(Err(self.verdict().await.err().unwrap_or_else(|| {
                                io::Error::new(
                                    io::ErrorKind::InvalidData,
                                    "trailing data after the payload",
                                )
                            })));
                        }
                        if let Some(previous) = self.held.replace(chunk) {
                            return Some(Ok(previous));
                        }
                    }
                    Some(Err(e)) => {
                        self.held = None;
                        self.tx = None;
                        if let Some(task) = self.check.take() {
                            task.abort();
                        }
                        return Some(Err(e));
                    }
                    None => {
                        return match self.verdict().await {
                            Ok(()) => self.held.take().map(Ok),
                            Err(e) => {
                                self.held = None;
                                Some(Err(e))
                            }
                        };
                    }
                }
            }
        }
    }
    impl Drop for Tee {
        fn drop(&mut self) {
            if let Some(task) = &self.check {
                task.abort();
            }
        }
    }
    let tee = Tee {
        input,
        tx: Some(tx),
        check: Some(check),
        held: None,
    };
    futures::stream::unfold(tee, |mut tee| async move {
        let item = tee.next().await?;
        Some((item, tee))
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::full::sealed_payload;
    use crate::store::compression::{chunked, collect, once};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_tee_passes_good_payloads_and_fails_corrupt_ones() {
        let good = sealed_payload(300_000);
        for codec in [Codec::None, Codec::Gzip, Codec::Zlib] {
            let stored = collect(
                codec
                    .encode(
                        once(good.clone()),
                        2,
                        crate::store::compression::Level::FAST,
                    )
                    .unwrap(),
            )
            .await
            .unwrap();
            let out = collect(verified(chunked(&stored, 4096), codec))
                .await
                .unwrap();
            assert_eq!(out, stored, "{codec}");

            let mut bad_plain = good.clone();
            bad_plain[1000] ^= 1;
            let bad = collect(
                codec
                    .encode(once(bad_plain), 2, crate::store::compression::Level::FAST)
                    .unwrap(),
            )
            .await
            .unwrap();
            let e = collect(verified(chunked(&bad, 4096), codec))
                .await
                .unwrap_err();
            assert!(e.to_string().contains("SHA-256"), "{codec}: {e}");
        }
        // A corrupt payload never passes its last chunk: what went downstream before the
        // error is short of the object, so an upload of known length cannot complete.
        let mut bad = good.clone();
        bad[5] ^= 1;
        let mut passed = 0;
        let mut out = verified(chunked(&bad, 4096), Codec::None);
        let mut failed = false;
        while let Some(item) = out.next().await {
            match item {
                Ok(b) => passed += b.len(),
                Err(_) => failed = true,
            }
        }
        assert!(failed);
        assert!(passed < good.len(), "passed {passed} of {}", good.len());
        // Not gzip at all: fails while decoding.
        let e = collect(verified(chunked(&[7u8; 100_000], 1000), Codec::Gzip))
            .await
            .unwrap_err();
        assert!(!e.to_string().is_empty());
    }

    /// The copy's check stops decoding at the source's bound: a decompression bomb fails as
    /// an oversized snapshot, and its last chunk never reaches the destination.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_check_of_a_copy_stops_at_the_decode_bound() {
        let zeros = vec![0u8; 8 << 20];
        let bomb = collect(
            Codec::Gzip
                .encode(
                    chunked(&zeros, 1 << 20),
                    2,
                    crate::store::compression::Level::FAST,
                )
                .unwrap(),
        )
        .await
        .unwrap();
        let source = SnapshotStore::new(
            std::sync::Arc::new(object_store::memory::InMemory::new()),
            "s",
        )
        .with_read_limits(crate::store::ReadLimits {
            max_delta_size: 1 << 20,
            max_inflation_ratio: 10,
            min_full_bound: 1 << 20,
        });
        for kind in [crate::store::Kind::Full, crate::store::Kind::Incr] {
            let snapshot = source.new_snapshot(kind, 1, 2, Codec::Gzip, false);
            let bound = source.bound_of(&snapshot, bomb.len() as u64);
            assert_eq!(bound.limit, 1 << 20, "{kind:?}");
            let e = collect(verified_within(chunked(&bomb, 4096), Codec::Gzip, bound))
                .await
                .unwrap_err();
            let oversized = Oversized::of(&e).unwrap_or_else(|| panic!("{kind:?}: {e}"));
            assert_eq!(oversized.snapshot, snapshot.snap_name);
        }
    }

    fn store_config(url: &str, endpoint: Option<&str>) -> StoreConfig {
        StoreConfig {
            endpoint: endpoint.map(String::from),
            ..StoreConfig::at(StoreLocation::parse(url).unwrap())
        }
    }

    #[test]
    fn one_bucket_of_one_service_is_copied_server_side() {
        let ep = Some("http://127.0.0.1:9000");
        let a = store_config("s3://bkt/old", ep);
        assert!(same_bucket(&a, &store_config("s3://bkt/new", ep)));
        assert!(!same_bucket(&a, &store_config("s3://other/new", ep)));
        assert!(!same_bucket(&a, &store_config("s3://bkt/new", None)));
        assert!(!same_bucket(&a, &store_config("gs://bkt/new", ep)));
        assert!(!same_bucket(
            &store_config("file:///a", None),
            &store_config("file:///b", None)
        ));
    }
}
