//! `leaked`: memory the snapshot leader's sidecar keeps for every event its delta writer
//! buffered. A run's own traffic is too slow for that to show in the 5 s resource samples (the
//! `delta-leak` plant's 1 KiB an event is a few MiB over a short run, inside the noise of a
//! 60 MiB process), so at the end, once the history is complete and etcd serves again, the
//! harness writes [`BURSTS`] bursts of [`BURST`] puts outside the traffic's prefix, waits each
//! time for a delta that holds the burst, and reads the leader's resident memory after each.
//! Memory a sidecar frees stays with its allocator after the first burst and is reused by the
//! next ones; memory it keeps per event grows with every burst. So the judge is the growth from
//! after the first burst to after the last ([`judge`]): more than [`BOUND_KIB`] over
//! `(BURSTS - 1) × BURST` events is `leaked`. A probe that cannot run once the history is
//! complete (no leader, no delta, the leader restarted or moved) is the violation
//! `leak-unjudged`, with why; only a run without a closing write (stopped on a plant's checker)
//! skips it, saying so in the summary.

use std::time::{Duration, Instant};

use futures::StreamExt;

use super::faultrun::{SIDECAR, World};
use etcd_warden::store::Kind;

/// Bursts written; the first warms the allocator up.
pub const BURSTS: usize = 4;
/// Puts in one burst.
pub const BURST: usize = 5_000;
/// Tries after the first for one put before the probe gives up (leak-unjudged).
const PUT_TRIES: u32 = 3;
/// Growth (KiB) from after the first burst to after the last that is a leak: about 420 bytes an
/// event over the last three bursts (the `delta-leak` plant keeps 1 KiB an event, 15 MiB).
pub const BOUND_KIB: u64 = 6 * 1024;
/// How long a burst's delta may take to be stored.
const DELTA_WITHIN: Duration = Duration::from_secs(60);

/// What the probe measured.
#[derive(Debug, Clone)]
pub struct Probe {
    /// The snapshot leader's member.
    pub member: usize,
    /// Its resident memory (KiB) after each burst's delta was stored.
    pub rss_after: Vec<u64>,
}

/// The verdict on `rss_after` (KiB, after each burst): the violation's detail when memory grew
/// past [`BOUND_KIB`] from after the first burst to after the last.
pub fn judge(member: usize, rss_after: &[u64]) -> Option<String> {
    let (first, last) = (*rss_after.first()?, *rss_after.last()?);
    let grew = last.saturating_sub(first);
    let events = rss_after.len().saturating_sub(1) * BURST;
    (grew > BOUND_KIB).then(|| {
        format!(
            "the snapshot leader's sidecar (m{member}) grew {grew} KiB over {events} events \
             written into its deltas after the first burst ({} bytes an event; resident KiB after \
             each burst: {rss_after:?}); memory freed after a delta is reused, memory kept per \
             event is a leak",
            grew * 1024 / events.max(1) as u64
        )
    })
}

/// Runs the bursts against `world` (its etcd serving, its sidecars active).
pub async fn probe(world: &World) -> Result<Probe, String> {
    let member = leader(world).await?;
    let pid = pid_of(world, member)?;
    let endpoints: Vec<String> = world.specs.iter().map(|s| s.client_url()).collect();
    let client = etcd_client::Client::connect(endpoints, None)
        .await
        .map_err(|e| format!("no etcd client: {e}"))?;
    let value = "x".repeat(64);
    let mut rss_after = Vec::new();
    for burst in 0..BURSTS {
        let revision = futures::stream::iter(0..BURST)
            .map(|i| {
                let mut kv = client.kv_client();
                let value = value.clone();
                async move {
                    // A put that times out on a loaded machine is put again (the same key and
                    // value: nothing judged here depends on how often): the probe is about the
                    // sidecar's memory, and only a put that keeps failing leaves it unjudged.
                    let key = format!("/leakprobe/{burst}/{i:05}");
                    let mut tries = 0;
                    loop {
                        match kv.put(key.clone(), value.clone(), None).await {
                            Ok(r) => break Ok(r.header().map_or(0, |h| h.revision())),
                            Err(e) if tries >= PUT_TRIES => break Err(e),
                            Err(_) => {
                                tries += 1;
                                tokio::time::sleep(Duration::from_millis(500)).await;
                            }
                        }
                    }
                }
            })
            .buffer_unordered(32)
            .fold(Ok(0i64), |acc, r| async move {
                match (acc, r) {
                    (Ok(a), Ok(r)) => Ok(a.max(r)),
                    (Err(e), _) | (_, Err(e)) => Err(e),
                }
            })
            .await
            .map_err(|e| format!("burst {burst}: a put failed: {e}"))?;
        wait_for_delta(world, revision).await?;
        if pid_of(world, member)? != pid || leader(world).await? != member {
            return Err(format!(
                "burst {burst}: the leader's sidecar restarted or leadership moved"
            ));
        }
        rss_after.push(settled_rss(pid).await?);
    }
    Ok(Probe { member, rss_after })
}

async fn leader(world: &World) -> Result<usize, String> {
    let statuses = world.sidecar_statuses().await;
    statuses
        .iter()
        .position(|s| {
            s.as_ref()
                .is_some_and(|s| s["snapshotter"]["leader"] == true)
        })
        .ok_or_else(|| "no sidecar says it is the snapshot leader".to_string())
}

fn pid_of(world: &World, member: usize) -> Result<i32, String> {
    world
        .kubelet
        .with_pod(member, |p| p.process(SIDECAR).and_then(|p| p.pid()))
        .ok_or_else(|| format!("m{member}'s sidecar is not running"))
}

/// Until a delta holding `revision` is listed in the world's store.
async fn wait_for_delta(world: &World, revision: i64) -> Result<(), String> {
    let started = Instant::now();
    while started.elapsed() < DELTA_WITHIN {
        let list = world.store.list().await.unwrap_or_default();
        if list
            .iter()
            .any(|s| s.kind == Kind::Incr && s.last_revision >= revision)
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Err(format!(
        "no delta holding revision {revision} within {DELTA_WITHIN:?}"
    ))
}

/// The smallest of three readings of the process's resident memory (KiB), half a second apart:
/// an upload's buffers in flight are not what the process keeps.
async fn settled_rss(pid: i32) -> Result<u64, String> {
    let mut least = u64::MAX;
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .map_err(|e| format!("reading /proc/{pid}/status: {e}"))?;
        let rss = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| format!("no VmRSS in /proc/{pid}/status"))?;
        least = least.min(rss);
    }
    Ok(least)
}

#[cfg(test)]
mod tests {
    use super::judge as judged;

    /// The judge, as the soak calls it.
    fn judge(member: usize, rss_after: &[u64]) -> Option<String> {
        judged(member, rss_after)
    }

    #[test]
    fn growth_after_the_first_burst_past_the_bound_is_a_leak() {
        // Allocator warm-up in the first burst, flat after: no leak.
        assert_eq!(judge(0, &[60_000, 61_000, 60_800, 61_500]), None);
        // The delta-leak plant: about 5 MiB a burst.
        let leak = judge(2, &[60_000, 65_100, 70_200, 75_300]).expect("a leak");
        assert!(leak.contains("m2") && leak.contains("15300 KiB"), "{leak}");
        // Right at the bound is not, just past it is.
        assert_eq!(judge(0, &[1000, 1000 + super::BOUND_KIB]), None);
        assert!(judge(0, &[1000, 1001 + super::BOUND_KIB]).is_some());
        // Nothing measured: nothing judged.
        assert_eq!(judge(0, &[]), None);
    }
}
