//! `GET /snapshot/latest` without a listing per request: anyone who reaches the port may ask, and
//! each answer is a LIST of the whole store (100 k objects: hundreds of MB and seconds of CPU), so
//! 256 keep-alive callers asking in a loop took the sidecar to 3.5 GB and `/healthz` to 10 s.
//!
//! One listing at a time: a request that finds no usable answer waits for the listing in flight
//! (or starts one) and shares its answer. The answer is serialised once and shared (`Bytes`), and
//! kept for at most [`LatestCache::max_age`] while what this sidecar knows of the store
//! ([`StoreVersion`]) is unchanged: a snapshot this sidecar stores, or the hand-off's final its
//! watchdog learns of, makes the next request list again, so readers polling for the final see it
//! as soon as it is stored. What another process stores (another member's sidecar, `compact`,
//! `reclaim`) is seen within the age.
//!
//! A listing nobody waits for any more (every caller gave up) is dropped, not left running, so a
//! store that hangs holds at most one listing, and the next caller starts a fresh one.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::http::StatusCode;
use bytes::Bytes;
use futures::FutureExt;
use futures::future::{BoxFuture, WeakShared};
use tokio::time::Instant;

use super::{ApiError, SnapshotApi};

/// How long an answer is kept when deltas are off (`snapshot.delta_period = 0`): the default delta
/// period, since nothing else bounds how often the store changes.
pub const MAX_AGE_WITHOUT_DELTAS: Duration = Duration::from_secs(20);

/// The longest `/snapshot/latest` keeps an answer with `snapshot.delta_period` = `delta_period`:
/// one delta period, or [`MAX_AGE_WITHOUT_DELTAS`] with deltas off.
pub fn max_age(delta_period: Duration) -> Duration {
    if delta_period.is_zero() {
        MAX_AGE_WITHOUT_DELTAS
    } else {
        delta_period
    }
}

/// What this sidecar knows, in memory, of changes to the store: a cached answer is served only
/// while this is what it was when its listing started.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreVersion {
    /// The snapshot actor's operations that stored or deleted something (or may have).
    pub changes: u64,
    /// The hand-off's final this sidecar's watchdog knows is stored (`/status` `owner.finalSnapshot`).
    pub final_snapshot: Option<String>,
}

/// One answer: the JSON body, or the error every caller waiting for it gets.
type Answer = Result<Bytes, ApiError>;

/// `GET /snapshot/latest`'s answers: one listing at a time, shared, kept for a bounded time.
pub struct LatestCache {
    max_age: Duration,
    /// Held while listing: one LIST at a time, even across store versions.
    listing: tokio::sync::Semaphore,
    slot: Mutex<Slot>,
}

#[derive(Default)]
struct Slot {
    /// The newest listing that succeeded.
    answer: Option<Cached>,
    /// The listing for the current version, while someone waits for it.
    flight: Option<Flight>,
    /// Flights started so far (each one's id).
    started: u64,
}

struct Cached {
    version: StoreVersion,
    /// When its listing started: the store was as listed at this time or later.
    listed_at: Instant,
    body: Bytes,
}

struct Flight {
    version: StoreVersion,
    id: u64,
    /// Weak: when every caller has given up, the listing is dropped with their handles.
    answer: WeakShared<BoxFuture<'static, Answer>>,
}

impl LatestCache {
    /// A cache keeping each answer for at most `max_age` (zero: only shared between the callers
    /// of one listing).
    pub fn new(max_age: Duration) -> Arc<Self> {
        Arc::new(LatestCache {
            max_age,
            listing: tokio::sync::Semaphore::new(1),
            slot: Mutex::new(Slot::default()),
        })
    }

    /// The longest an answer is kept.
    pub fn max_age(&self) -> Duration {
        self.max_age
    }

    fn slot(&self) -> MutexGuard<'_, Slot> {
        // Nothing panics while holding it; a poisoned slot still holds consistent data.
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The answer as JSON: kept, shared with the listing in flight for the same version, or
    /// listed now through `api`.
    pub async fn get(self: &Arc<Self>, api: &Arc<dyn SnapshotApi>) -> Answer {
        // Read before the listing starts: a change after this makes the answer stale, never the
        // other way round.
        let version = api.version();
        let answer = {
            let mut slot = self.slot();
            if let Some(c) = &slot.answer
                && c.version == version
                && c.listed_at.elapsed() < self.max_age
            {
                return Ok(c.body.clone());
            }
            let joined = slot
                .flight
                .as_ref()
                .filter(|f| f.version == version)
                .and_then(|f| f.answer.upgrade());
            match joined {
                Some(answer) => answer,
                None => {
                    slot.started += 1;
                    let id = slot.started;
                    let answer = self
                        .clone()
                        .list(api.clone(), version.clone(), id)
                        .boxed()
                        .shared();
                    slot.flight = answer.downgrade().map(|weak| Flight {
                        version,
                        id,
                        answer: weak,
                    });
                    answer
                }
            }
        };
        answer.await
    }

    /// One listing, after the one in flight (of an older version) if any; kept when it is the
    /// newest.
    async fn list(
        self: Arc<Self>,
        api: Arc<dyn SnapshotApi>,
        version: StoreVersion,
        id: u64,
    ) -> Answer {
        let _one = self.listing.acquire().await.map_err(|_| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "the server is stopping",
            )
        })?;
        let listed_at = Instant::now();
        let answer = api.latest().await.and_then(|chain| {
            serde_json::to_vec(&chain).map(Bytes::from).map_err(|e| {
                tracing::error!(error = %e, "encoding the latest snapshots failed");
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "encoding the answer failed",
                )
            })
        });
        let mut slot = self.slot();
        if let Ok(body) = &answer
            && slot
                .answer
                .as_ref()
                .is_none_or(|c| c.listed_at <= listed_at)
        {
            slot.answer = Some(Cached {
                version,
                listed_at,
                body: body.clone(),
            });
        }
        // An error is shared by this listing's callers only: the next caller lists again.
        if slot.flight.as_ref().is_some_and(|f| f.id == id) {
            slot.flight = None;
        }
        answer
    }
}
