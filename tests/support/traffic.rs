//! Client traffic with a recorded history, for the robustness harness: workers that put values
//! of varied sizes (to 1.4 MiB, under etcd's 1.5 MiB request limit), delete single keys and
//! ranges, run compare-and-put transactions and linearizable reads; a watcher; and a compactor
//! that compacts etcd's history every so often, as kube-apiserver does. Everything goes through
//! one endpoint (the Service) and is recorded as [`kvcheck::Op`]s and [`kvcheck::WatchStream`]s.
//!
//! Key spaces (each judged by the same model):
//! - `/soak/k/<nnn>`: 384 hot keys: puts, deletes, transactions, reads;
//! - `/soak/end/<n>`: the closing write of [`Traffic::complete_history`];
//! - `/soak/r/<w>-<batch>/<i>`: a batch of keys put, then deleted as a range;
//! - `/soak/big/<w>-<batch>/<i>`: a few large values, deleted as a range a little later.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, DeleteOptions, EventType, GetOptions, Txn, TxnOp, WatchOptions,
};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::kvcheck::{Call, Op, Ret, Seen, WatchEvent, WatchStream, id_of, value_of};
use super::schedule::SplitMix64;

/// The prefix every traffic key lives under.
pub const PREFIX: &str = "/soak/";
const HOT_KEYS: u64 = 384;
/// etcd's default request limit is 1.5 MiB; a value stays below it with its key and framing.
const MAX_VALUE: u64 = 1_400 * 1024;

#[derive(Default)]
struct Log {
    ops: Vec<Op>,
    watches: Vec<WatchStream>,
    compactions: Vec<(Duration, i64)>,
    errors: Vec<(Duration, String)>,
}

/// Where the traffic connects: asked again at every connection (a cluster whose members the
/// operator replaces has new URLs).
pub type Endpoints = Arc<dyn Fn() -> Vec<String> + Send + Sync>;

/// Endpoints that never change (a Service).
pub fn fixed(endpoint: String) -> Endpoints {
    Arc::new(move || vec![endpoint.clone()])
}

/// A client for the current endpoints, as the writers connect (500 ms to connect, 2 s a
/// request, the whole attempt within 2 s).
async fn connect(endpoints: &Endpoints) -> Result<Client, String> {
    let urls = endpoints();
    let options = etcd_client::ConnectOptions::new()
        .with_connect_timeout(Duration::from_millis(500))
        .with_timeout(Duration::from_secs(2));
    match tokio::time::timeout(Duration::from_secs(2), Client::connect(urls, Some(options))).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(format!("connect: {e}")),
        Err(_) => Err("connect: timed out".into()),
    }
}

/// Running traffic; stops on [`Traffic::stop`] or drop.
pub struct Traffic {
    log: Arc<Mutex<Log>>,
    paused: Arc<AtomicBool>,
    acked: Arc<AtomicU64>,
    stop: CancellationToken,
    /// The workers' own token: they stop first, the watcher goes on to complete the history.
    stop_workers: CancellationToken,
    workers: Vec<JoinHandle<()>>,
    tasks: Vec<JoinHandle<()>>,
    endpoints: Endpoints,
    epoch: Instant,
}

/// What the traffic recorded.
pub struct Recorded {
    pub ops: Vec<Op>,
    pub watches: Vec<WatchStream>,
    pub compactions: Vec<(Duration, i64)>,
    pub errors: Vec<(Duration, String)>,
}

impl Traffic {
    /// Starts `workers` workers, a watcher and a compactor (every `compact_every`, to the
    /// revision seen that long before) against `endpoint`; times from `epoch`.
    pub fn start(
        endpoints: Endpoints,
        seed: u64,
        workers: u32,
        epoch: Instant,
        compact_every: Duration,
    ) -> Traffic {
        let log = Arc::new(Mutex::new(Log::default()));
        let paused = Arc::new(AtomicBool::new(false));
        let acked = Arc::new(AtomicU64::new(0));
        let stop = CancellationToken::new();
        let stop_workers = stop.child_token();
        let mut tasks = Vec::new();
        let mut worker_tasks = Vec::new();
        for w in 0..workers {
            worker_tasks.push(tokio::spawn(worker(
                endpoints.clone(),
                w,
                SplitMix64::new(seed ^ (0x5eed_0000 + w as u64)),
                epoch,
                log.clone(),
                paused.clone(),
                acked.clone(),
                stop_workers.clone(),
            )));
        }
        tasks.push(tokio::spawn(watcher(
            endpoints.clone(),
            epoch,
            log.clone(),
            stop.clone(),
        )));
        tasks.push(tokio::spawn(compactor(
            endpoints.clone(),
            epoch,
            compact_every,
            log.clone(),
            stop.clone(),
        )));
        Traffic {
            log,
            paused,
            acked,
            stop,
            stop_workers,
            workers: worker_tasks,
            tasks,
            endpoints,
            epoch,
        }
    }

    /// Acknowledged writes so far.
    pub fn acked(&self) -> u64 {
        self.acked.load(Ordering::SeqCst)
    }

    /// Pauses or resumes the workers' writes (reads go on).
    pub fn pause_writes(&self, paused: bool) {
        self.paused.store(paused, Ordering::SeqCst);
    }

    /// A copy of the history so far.
    pub fn snapshot(&self) -> Recorded {
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        Recorded {
            ops: log.ops.clone(),
            watches: log.watches.clone(),
            compactions: log.compactions.clone(),
            errors: log.errors.clone(),
        }
    }

    /// Stops every task (a write in flight is recorded with no answer: it may be applied).
    pub async fn stop(&mut self) {
        self.stop_writes().await;
        self.stop.cancel();
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
    }

    /// Stops the workers (the watcher and the compactor go on).
    pub async fn stop_writes(&mut self) {
        self.stop_workers.cancel();
        for t in self.workers.drain(..) {
            let _ = t.await;
        }
    }

    /// Completes the revision history once the workers stopped: a closing put (recorded, with
    /// a value of its own), then waits until the watch delivered its revision, so the watch
    /// holds every revision up to it, and no worker writes after it. A write whose answer was
    /// lost is given 6 s (past the workers' 5 s bound) to land first. Returns the closing
    /// write's revision.
    pub async fn complete_history(&mut self, within: Duration) -> Result<i64, String> {
        self.stop_writes().await;
        let deadline = Instant::now() + within;
        tokio::time::sleep(Duration::from_secs(6)).await;
        let mut n = 0;
        let revision = loop {
            n += 1;
            let key = format!("{PREFIX}end/{n}");
            let id = format!("end-{n}");
            let invoked = self.epoch.elapsed();
            let ret = match connect(&self.endpoints).await {
                Ok(mut c) => match tokio::time::timeout(
                    Duration::from_secs(5),
                    perform(
                        &mut c,
                        &Call::Put {
                            key: key.clone(),
                            id: id.clone(),
                        },
                        16,
                    ),
                )
                .await
                {
                    Ok(Ok(ret)) => ret,
                    _ => Ret::Unknown,
                },
                Err(_) => Ret::Unknown,
            };
            let op = Op {
                worker: u32::MAX,
                call: Call::Put { key, id },
                invoked,
                completed: self.epoch.elapsed(),
                ret,
            };
            let r = op.write_revision();
            self.log
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .ops
                .push(op);
            if let Some(r) = r {
                break r;
            }
            if Instant::now() >= deadline {
                return Err(format!("no closing write succeeded in {within:?}"));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        loop {
            let covered = {
                let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
                log.watches.last().map_or(0, |s| s.covered)
            };
            if covered >= revision {
                return Ok(revision);
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "the watch delivered revision {covered}, not the closing write's {revision}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn note_error(log: &Mutex<Log>, epoch: Instant, e: String) {
    let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
    log.errors.push((epoch.elapsed(), e));
    let excess = log.errors.len().saturating_sub(50);
    log.errors.drain(..excess);
}

/// A value length: mostly small, sometimes kilobytes, rarely up to [`MAX_VALUE`].
fn value_len(rng: &mut SplitMix64) -> usize {
    match rng.range(0, 999) {
        0..=699 => rng.range(8, 200) as usize,
        700..=989 => rng.range(1024, 64 * 1024) as usize,
        _ => rng.range(256 * 1024, MAX_VALUE) as usize,
    }
}

#[allow(clippy::too_many_arguments)]
async fn worker(
    endpoints: Endpoints,
    w: u32,
    mut rng: SplitMix64,
    epoch: Instant,
    log: Arc<Mutex<Log>>,
    paused: Arc<AtomicBool>,
    acked: Arc<AtomicU64>,
    stop: CancellationToken,
) {
    let mut client: Option<Client> = None;
    let mut n: u64 = 0;
    let mut batch: u64 = 0;
    // The range batch being filled: (prefix, keys put so far).
    let mut range: Option<(String, u64)> = None;
    // The last mod revision read per hot key, for transactions.
    let mut last_mod: std::collections::HashMap<String, i64> = Default::default();
    while !stop.is_cancelled() {
        if client.is_none() {
            match connect(&endpoints).await {
                Ok(c) => client = Some(c),
                Err(e) => {
                    note_error(&log, epoch, format!("w{w}: {e}"));
                    pause(&stop, 100).await;
                    continue;
                }
            }
        }
        let Some(c) = client.as_mut() else { continue };
        let writes = !paused.load(Ordering::SeqCst);
        let hot = format!("{PREFIX}k/{:03}", rng.range(0, HOT_KEYS - 1));
        n += 1;
        let id = format!("w{w}-{n}");
        let call = match rng.range(0, 99) {
            _ if !writes => Call::Get { key: hot },
            0..=34 => Call::Put {
                key: hot,
                id: id.clone(),
            },
            35..=44 => Call::Delete { key: hot },
            45..=54 => Call::Txn {
                expect: last_mod.get(&hot).copied().unwrap_or(0),
                key: hot,
                id: id.clone(),
            },
            55..=69 => match range.take() {
                Some((prefix, count)) if count >= 5 => {
                    batch += 1;
                    Call::DeleteRange { prefix }
                }
                open => {
                    let (prefix, count) = open.unwrap_or_else(|| {
                        let kind = if rng.chance(10) { "big" } else { "r" };
                        (format!("{PREFIX}{kind}/{w}-{batch}/"), 0)
                    });
                    let key = format!("{prefix}{count}");
                    range = Some((prefix, count + 1));
                    Call::Put {
                        key,
                        id: id.clone(),
                    }
                }
            },
            _ => Call::Get { key: hot },
        };
        let len = if call.key_is_big() {
            rng.range(256 * 1024, MAX_VALUE) as usize
        } else {
            value_len(&mut rng).min(64 * 1024)
        };
        let invoked = epoch.elapsed();
        let answer = tokio::select! {
            _ = stop.cancelled() => {
                // Abandoned in flight: it may still be applied, so it stays in the history.
                if !matches!(call, Call::Get { .. }) {
                    log.lock().unwrap_or_else(|e| e.into_inner()).ops.push(Op {
                        worker: w,
                        call,
                        invoked,
                        completed: epoch.elapsed(),
                        ret: Ret::Unknown,
                    });
                }
                return;
            }
            a = tokio::time::timeout(Duration::from_secs(5), perform(c, &call, len)) => a,
        };
        let ret = match answer {
            Ok(Ok(ret)) => ret,
            Ok(Err(e)) => {
                note_error(&log, epoch, format!("w{w} {call:?}: {e}"));
                client = None;
                Ret::Unknown
            }
            Err(_) => {
                note_error(&log, epoch, format!("w{w} {call:?}: timed out"));
                client = None;
                Ret::Unknown
            }
        };
        if let (Call::Get { key }, Ret::Read { kv, .. }) = (&call, &ret) {
            last_mod.insert(key.clone(), kv.as_ref().map_or(0, |s| s.mod_revision));
        }
        let op = Op {
            worker: w,
            call,
            invoked,
            completed: epoch.elapsed(),
            ret,
        };
        if op.write_revision().is_some() {
            acked.fetch_add(1, Ordering::SeqCst);
        }
        // A read that failed changed nothing: it is not part of the history.
        let failed_read = matches!(op.call, Call::Get { .. }) && op.ret == Ret::Unknown;
        if !failed_read {
            log.lock().unwrap_or_else(|e| e.into_inner()).ops.push(op);
        }
        if client.is_none() {
            pause(&stop, 50).await;
        } else {
            pause(&stop, rng.range(5, 40)).await;
        }
    }
}

impl Call {
    fn key_is_big(&self) -> bool {
        matches!(self, Call::Put { key, .. } if key.starts_with(&format!("{PREFIX}big/")))
    }
}

async fn perform(c: &mut Client, call: &Call, len: usize) -> Result<Ret, etcd_client::Error> {
    let written = |revision: i64, succeeded: bool| Ret::Write {
        revision,
        succeeded,
    };
    let header_rev = |h: Option<&etcd_client::ResponseHeader>| h.map_or(0, |h| h.revision());
    Ok(match call {
        Call::Put { key, id } => {
            let r = c.put(key.as_str(), value_of(id, len), None).await?;
            written(header_rev(r.header()), true)
        }
        Call::Delete { key } => {
            let r = c.delete(key.as_str(), None).await?;
            written(header_rev(r.header()), r.deleted() > 0)
        }
        Call::DeleteRange { prefix } => {
            let r = c
                .delete(prefix.as_str(), Some(DeleteOptions::new().with_prefix()))
                .await?;
            written(header_rev(r.header()), r.deleted() > 0)
        }
        Call::Txn { key, expect, id } => {
            let txn = Txn::new()
                .when([Compare::mod_revision(
                    key.as_str(),
                    CompareOp::Equal,
                    *expect,
                )])
                .and_then([TxnOp::put(key.as_str(), value_of(id, len), None)]);
            let r = c.txn(txn).await?;
            written(header_rev(r.header()), r.succeeded())
        }
        Call::Get { key } => {
            let r = c.get(key.as_str(), None).await?;
            let kv = r.kvs().first().map(|kv| Seen {
                id: id_of(kv.value()).unwrap_or_else(|| {
                    format!("<not a traffic value, {} bytes>", kv.value().len())
                }),
                mod_revision: kv.mod_revision(),
            });
            Ret::Read {
                revision: header_rev(r.header()),
                kv,
            }
        }
    })
}

async fn pause(stop: &CancellationToken, ms: u64) {
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = tokio::time::sleep(Duration::from_millis(ms)) => {}
    }
}

/// Watches [`PREFIX`] from the first revision on, one stream after another: a stream that ends
/// (error, lost connection) is followed by one from the revision after its last progress; a
/// stream whose start was compacted away is recorded as such and the next starts at the
/// compacted revision.
async fn watcher(
    endpoints: Endpoints,
    epoch: Instant,
    log: Arc<Mutex<Log>>,
    stop: CancellationToken,
) {
    // From revision 1: the revision history (revmodel.rs) is complete only if the watch holds
    // every revision of the prefix, and the compactor never compacts past what it delivered.
    let mut next: i64 = 1;
    while !stop.is_cancelled() {
        let Ok(client) = connect(&endpoints).await else {
            pause(&stop, 200).await;
            continue;
        };
        let index = {
            let mut l = log.lock().unwrap_or_else(|e| e.into_inner());
            l.watches.push(WatchStream {
                start: next,
                events: Vec::new(),
                // Nothing of this stream delivered yet.
                covered: next - 1,
                compacted: false,
            });
            l.watches.len() - 1
        };
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(next)
            .with_progress_notify();
        // A batch of large values is far beyond gRPC's default 4 MiB (as for the sidecar).
        let stream = client
            .watch_client()
            .max_decoding_message_size(i32::MAX as usize)
            .watch(PREFIX, Some(options))
            .await;
        let Ok(mut stream) = stream else {
            pause(&stop, 200).await;
            continue;
        };
        loop {
            let msg = tokio::select! {
                _ = stop.cancelled() => return,
                m = tokio::time::timeout(Duration::from_secs(30), stream.message()) => m,
            };
            let Ok(Ok(Some(resp))) = msg else { break };
            let mut l = log.lock().unwrap_or_else(|e| e.into_inner());
            let s = &mut l.watches[index];
            if resp.compact_revision() > 0 {
                s.compacted = true;
                next = resp.compact_revision();
                break;
            }
            if resp.canceled() {
                break;
            }
            for e in resp.events() {
                let Some(kv) = e.kv() else { continue };
                let key = String::from_utf8_lossy(kv.key()).into_owned();
                let id = match e.event_type() {
                    EventType::Put => Some(id_of(kv.value()).unwrap_or_else(|| {
                        format!("<not a traffic value, {} bytes>", kv.value().len())
                    })),
                    EventType::Delete => None,
                };
                s.events.push(WatchEvent {
                    key,
                    revision: kv.mod_revision(),
                    id,
                });
                s.covered = s.covered.max(kv.mod_revision());
            }
            // A progress notification (no events, not the creation): everything up to its
            // header revision was delivered. An event response's header may run ahead of events
            // still to come while the stream catches up, so it proves nothing.
            if resp.events().is_empty()
                && !resp.created()
                && let Some(h) = resp.header()
            {
                s.covered = s.covered.max(h.revision());
            }
            next = s.covered + 1;
        }
        let _ = epoch;
        pause(&stop, 100).await;
    }
}

/// Every `every`, compacts etcd to the revision it saw `every` before (kube-apiserver compacts
/// every 5 minutes the same way), recording each compaction; never past a revision the watch has
/// delivered, so the recorded history stays complete.
async fn compactor(
    endpoints: Endpoints,
    epoch: Instant,
    every: Duration,
    log: Arc<Mutex<Log>>,
    stop: CancellationToken,
) {
    let mut previous: Option<i64> = None;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let Ok(mut client) = connect(&endpoints).await else {
            continue;
        };
        let Ok(r) = client.get("/", Some(GetOptions::new().with_limit(1))).await else {
            continue;
        };
        let now = r.header().map_or(0, |h| h.revision());
        let delivered = {
            let l = log.lock().unwrap_or_else(|e| e.into_inner());
            l.watches.last().map_or(0, |s| s.covered)
        };
        if let Some(rev) = previous.map(|p| p.min(delivered))
            && rev > 0
            && client.compact(rev, None).await.is_ok()
        {
            log.lock()
                .unwrap_or_else(|e| e.into_inner())
                .compactions
                .push((epoch.elapsed(), rev));
        }
        previous = Some(now);
    }
}
