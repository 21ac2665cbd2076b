//! Deltas judged against the revision history: at the end of a run, for every chain (a full
//! snapshot and the deltas after it) of each store, revisions chosen by the seed, the chain's
//! first and last delta boundary among them, are restored with `etcd-warden restore
//! --to-revision R`, and the restored traffic keys must be the model's state at `R`
//! ([`super::revmodel`]): keys, values, create and mod revisions, versions (`delta-history`).
//!
//! And the strict delta-gap check ([`gaps`]): a delta that does not follow its predecessor is
//! excused only by a store fault covering the moment the missing delta would have been stored,
//! and then the next snapshot must be a full one (`delta-gap`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, SystemTime};

use etcd_warden::store::{Kind, Snapshot};

use super::etcd::Release;
use super::revmodel::{KeyState, RevModel};
use super::schedule::SplitMix64;

/// One chain: its full snapshot and the deltas after it, in revision order.
#[derive(Debug, Clone)]
pub struct Chain<'a> {
    pub full: &'a Snapshot,
    pub deltas: Vec<&'a Snapshot>,
}

/// The chains of a listing (deltas before any full belong to none).
pub fn chains(snapshots: &[Snapshot]) -> Vec<Chain<'_>> {
    let mut sorted: Vec<&Snapshot> = snapshots.iter().collect();
    sorted.sort_by_key(|s| (s.last_revision, s.kind != Kind::Full, s.start_revision));
    let mut out: Vec<Chain<'_>> = Vec::new();
    for s in sorted {
        match s.kind {
            Kind::Full => out.push(Chain {
                full: s,
                deltas: Vec::new(),
            }),
            _ => {
                // A delta the full already covers (an overlapping snapshot leader's, stored
                // before the full) is not in its chain: a restore skips it, and a drill's
                // count of deltas does not include it.
                if let Some(c) = out.last_mut()
                    && s.last_revision > c.full.last_revision
                {
                    c.deltas.push(s);
                }
            }
        }
    }
    out
}

/// Up to `per_chain` revisions of `chain` the model knows: its full's revision (where the first
/// delta starts), its first and last delta boundaries, then boundaries and revisions inside
/// deltas drawn by `rng`.
pub fn choose(
    chain: &Chain<'_>,
    per_chain: usize,
    rng: &mut SplitMix64,
    knows: impl Fn(i64) -> bool,
) -> Vec<i64> {
    let mut out: Vec<i64> = Vec::new();
    let add = |out: &mut Vec<i64>, r: i64| {
        if knows(r) && !out.contains(&r) && out.len() < per_chain {
            out.push(r);
        }
    };
    if let (Some(first), Some(last)) = (chain.deltas.first(), chain.deltas.last()) {
        add(&mut out, first.last_revision);
        add(&mut out, last.last_revision);
    }
    add(&mut out, chain.full.last_revision);
    let lo = chain.full.last_revision;
    let hi = chain.deltas.last().map_or(lo, |d| d.last_revision);
    let mut tries = 0;
    while out.len() < per_chain && tries < 8 * per_chain && !chain.deltas.is_empty() {
        tries += 1;
        let r = if rng.chance(50) {
            chain.deltas[rng.range(0, chain.deltas.len() as u64 - 1) as usize].last_revision
        } else {
            rng.range(lo as u64, hi as u64) as i64
        };
        add(&mut out, r);
    }
    out.sort_unstable();
    out
}

/// Differences between a restored cluster's keys and the model's.
pub fn differences(
    want: &BTreeMap<String, KeyState>,
    got: &BTreeMap<String, KeyState>,
) -> Vec<String> {
    let mut out = Vec::new();
    let keys: BTreeSet<&String> = want.keys().chain(got.keys()).collect();
    for k in keys {
        match (want.get(k), got.get(k)) {
            (Some(w), Some(g)) if w == g => {}
            (w, g) => out.push(format!("{k}: restored {g:?}, the history holds {w:?}")),
        }
    }
    out
}

/// Where to restore from: a label, the store (listed again after a failure) and the keys that
/// point the CLI at it.
pub struct Source {
    pub label: &'static str,
    pub snapshots: Vec<Snapshot>,
    pub store: etcd_warden::store::SnapshotStore,
    pub keys: Vec<(String, String)>,
}

/// What [`judge`] found and did.
#[derive(Debug, Default)]
pub struct Outcome {
    pub violations: Vec<String>,
    pub restores: usize,
    pub chains: usize,
    /// Restores that failed because retention deleted a snapshot they needed meanwhile, each
    /// with the names gone.
    pub gone: Vec<String>,
    /// Targets a full snapshot's raced writes put out of reach, judged where it holds instead.
    pub raced: usize,
    /// Passed drills whose chain starts after the history ends (reported, not judged).
    pub unjudged: Vec<String>,
}

/// The snapshots a restore of `chain` to revision `r` reads: its full snapshot and its deltas
/// up to the first that reaches `r`.
pub fn needed(chain: &Chain<'_>, r: i64) -> Vec<String> {
    let mut out = vec![chain.full.snap_name.clone()];
    if r > chain.full.last_revision {
        for d in &chain.deltas {
            out.push(d.snap_name.clone());
            if d.last_revision >= r {
                break;
            }
        }
    }
    out
}

/// Whether a failed restore is retention's doing, not a defect: some snapshot it `needed` is
/// no longer in the store's listing `now`, and the failure is one a missing snapshot gives (not
/// found while fetching it; listed without it, a gap, a target in no delta or before the
/// oldest full snapshot). Returns the names gone. A failure with every needed snapshot still
/// listed, or another failure, is judged as failed (robustness finding 8: this excuse once
/// matched only "not found", and a chain retention trimmed before the restore listed it read
/// as a gap).
pub fn gone_by_retention(needed: &[String], now: &[Snapshot], said: &str) -> Option<Vec<String>> {
    let missing: Vec<String> = needed
        .iter()
        .filter(|n| !now.iter().any(|s| &s.snap_name == *n))
        .cloned()
        .collect();
    let shape = [
        "not found",
        "NotFound",
        "revision gap in the latest chain",
        "is in no delta",
        "is before the oldest full snapshot",
    ];
    (!missing.is_empty() && shape.iter().any(|p| said.contains(p))).then_some(missing)
}

/// The revision a restore refused `target` for because the full snapshot's database already
/// holds writes past it (`restore::direct`'s "holds revisions up to N (writes that raced the
/// snapshot), beyond the target revision R"), if that is what `said` says; only a revision past
/// the target counts.
pub fn raced_to(said: &str, target: i64) -> Option<i64> {
    let rest = said
        .split("the full snapshot's database holds revisions up to ")
        .nth(1)?;
    let (held, rest) = rest.split_once(' ')?;
    let held: i64 = held.parse().ok()?;
    let beyond = rest.split("beyond the target revision ").nth(1)?;
    let named: i64 = beyond
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()?;
    (named == target && held > target).then_some(held)
}

/// Restores the chosen revisions of every chain of every source and compares each with the
/// model; `keys` is the CLI's configuration, each source's keys override it.
#[allow(clippy::too_many_arguments)]
pub async fn judge(
    model: &RevModel,
    prefix: &str,
    keys: &[(String, String)],
    sources: &[Source],
    per_chain: usize,
    max_restores: usize,
    seed: u64,
    release: Release,
    dir: &Path,
) -> Outcome {
    let mut rng = SplitMix64::new(seed ^ 0xde17_a5ec);
    let mut out = Outcome::default();
    let judge = Judge {
        model,
        prefix,
        keys,
        release,
        dir,
    };
    for source in sources {
        for chain in chains(&source.snapshots) {
            out.chains += 1;
            for chosen in choose(&chain, per_chain, &mut rng, |r| model.knows(r)) {
                if out.restores >= max_restores {
                    return out;
                }
                judge.target(source, &chain, chosen, &mut out).await;
            }
        }
    }
    out
}

/// The revision a passed drill's preserved chain is judged at: the newest one the history
/// knows from the full's revision up to what the drill saw etcd serve, and no later than the
/// newest revision a snapshot of the chain names. etcd may serve past that (a full snapshot
/// holds the writes that raced it); a target there is refused by the restore, so the chain is
/// judged at its newest name and the raced path ([`raced_to`]) judges it where it holds.
pub fn drill_target(
    full_revision: i64,
    served: i64,
    newest_named: Option<i64>,
    knows: impl Fn(i64) -> bool,
) -> Option<i64> {
    let last = newest_named.map_or(served, |n| served.min(n));
    (full_revision..=last).rev().find(|r| knows(*r))
}

/// A drill that passed, as `verify --restore` printed it: the chain it restored (its full
/// snapshot and how many deltas) and the revision etcd served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PassedDrill {
    pub full: String,
    pub deltas: usize,
    pub revision: i64,
}

/// The drill `said` reports as passed (`ok    restore drill: <full> and <n> deltas restored in
/// …; etcd serves revision <r>, …`), if it says so.
pub fn passed_drill(said: &str) -> Option<PassedDrill> {
    let line = said
        .lines()
        .find_map(|l| l.trim().strip_prefix("ok    restore drill: "))?;
    let (full, rest) = line.split_once(" and ")?;
    let (deltas, rest) = rest.split_once(" deltas restored")?;
    let revision = rest.split("etcd serves revision ").nth(1)?;
    let revision = revision.split(|c: char| !c.is_ascii_digit()).next()?;
    Some(PassedDrill {
        full: full.to_string(),
        deltas: deltas.parse().ok()?,
        revision: revision.parse().ok()?,
    })
}

/// A passed drill's chain, copied out of its store right after the drill (retention may delete
/// it before the run ends): its objects in a store on disk of the harness's own.
#[derive(Debug, Clone)]
pub struct PreservedDrill {
    /// The store the drill ran on.
    pub label: &'static str,
    pub drill: PassedDrill,
    /// The copy's root (`file://` store; objects under `v2/`).
    pub root: std::path::PathBuf,
    /// The chain copied: its full snapshot and the deltas the drill read.
    pub snapshots: Vec<Snapshot>,
}

/// Copies the chain `drill` restored out of `store` into `root`, or says why it cannot (the
/// chain is no longer listed: retention, in the moment since the drill).
pub async fn preserve(
    label: &'static str,
    store: &etcd_warden::store::SnapshotStore,
    drill: PassedDrill,
    root: &Path,
) -> Result<PreservedDrill, String> {
    use futures::TryStreamExt as _;
    let listed = store
        .list()
        .await
        .map_err(|e| format!("listing the {label} store: {e}"))?;
    let found = chains(&listed)
        .into_iter()
        .find(|c| c.full.snap_name == drill.full);
    let Some(mut chain) = found else {
        return Err(format!(
            "{label}: the drill's chain of {} is no longer listed",
            drill.full
        ));
    };
    chain.deltas.truncate(drill.deltas);
    let layout = root.join("v2");
    std::fs::create_dir_all(&layout).map_err(|e| format!("{}: {e}", layout.display()))?;
    let mut snapshots = Vec::new();
    for s in std::iter::once(chain.full).chain(chain.deltas.iter().copied()) {
        let stream = store
            .get_stream(s)
            .await
            .map_err(|e| format!("{label}: reading {}: {e}", s.snap_name))?;
        let chunks: Vec<bytes::Bytes> = stream
            .try_collect()
            .await
            .map_err(|e| format!("{label}: reading {}: {e}", s.snap_name))?;
        std::fs::write(layout.join(&s.snap_name), chunks.concat())
            .map_err(|e| format!("{}: {e}", layout.display()))?;
        snapshots.push(s.clone());
    }
    Ok(PreservedDrill {
        label,
        drill,
        root: root.to_path_buf(),
        snapshots,
    })
}

/// Every passed drill's chain (preserved by [`preserve`]) restored by the harness itself at the
/// revision the drill saw etcd serve, and compared with the model: a drill passes only by
/// comparing the restore with its chain, so a restore the history disagrees with under a drill
/// that passed means the drill compared nothing (`drill-compared-nothing`, in
/// `Outcome::violations`). Nothing is excused: the copy is the harness's, retention never
/// touches it.
pub async fn judge_drills(
    model: &RevModel,
    prefix: &str,
    keys: &[(String, String)],
    drills: &[PreservedDrill],
    release: Release,
    dir: &Path,
) -> Outcome {
    let mut out = Outcome::default();
    let judge = Judge {
        model,
        prefix,
        keys,
        release,
        dir,
    };
    for p in drills {
        let drill = &p.drill;
        // The history may end a little before the store (the run's last revisions, leases
        // expiring after the final): the chain is judged at the newest revision both hold.
        let full_revision = p
            .snapshots
            .iter()
            .find(|s| s.snap_name == drill.full)
            .map_or(i64::MAX, |s| s.last_revision);
        let newest_named = p.snapshots.iter().map(|s| s.last_revision).max();
        let at = drill_target(full_revision, drill.revision, newest_named, |r| {
            model.knows(r)
        });
        let Some(at) = at else {
            out.unjudged.push(format!(
                "{} drill of {} (revision {}): the history ends at {}, before the chain",
                p.label, drill.full, drill.revision, model.complete_to
            ));
            continue;
        };
        let store = etcd_warden::store::SnapshotStore::new(
            std::sync::Arc::new(
                object_store::local::LocalFileSystem::new_with_prefix(&p.root)
                    .expect("the preserved chain's directory"),
            ),
            "",
        );
        let source = Source {
            label: p.label,
            snapshots: p.snapshots.clone(),
            store,
            keys: vec![("store.url".into(), format!("file://{}", p.root.display()))],
        };
        let Some(chain) = chains(&source.snapshots).into_iter().next() else {
            continue;
        };
        out.chains += 1;
        let mut one = Outcome::default();
        judge.target(&source, &chain, at, &mut one).await;
        out.restores += one.restores;
        out.raced += one.raced;
        out.violations.extend(one.violations.into_iter().map(|v| {
            format!(
                "the drill passed on this chain ({} and {} deltas, revision {}), yet {v}",
                drill.full, drill.deltas, drill.revision
            )
        }));
        out.violations.extend(
            one.gone.into_iter().map(|g| {
                format!("the preserved copy of a passed drill's chain lost a snapshot: {g}")
            }),
        );
    }
    out
}

/// What one restore is judged against: the model, the keys compared, the CLI's configuration.
struct Judge<'a> {
    model: &'a RevModel,
    prefix: &'a str,
    keys: &'a [(String, String)],
    release: Release,
    dir: &'a Path,
}

impl Judge<'_> {
    /// Restores `chain` of `source` to revision `chosen` and compares it with the model; what
    /// it finds goes into `out`.
    async fn target(&self, source: &Source, chain: &Chain<'_>, chosen: i64, out: &mut Outcome) {
        let (model, prefix, release, dir) = (self.model, self.prefix, self.release, self.dir);
        let bin = release.bin_dir().to_string_lossy().into_owned();
        let chain_end = chain
            .deltas
            .last()
            .map_or(chain.full.last_revision, |d| d.last_revision);
        let mut r = chosen;
        loop {
            out.restores += 1;
            let target = dir.join(format!("{}-{r}", source.label)).join("data");
            let mut all = self.keys.to_vec();
            all.retain(|(k, _)| !source.keys.iter().any(|(x, _)| x == k));
            // A store on disk of the harness's own: no endpoint, region or credentials.
            if source
                .keys
                .iter()
                .any(|(k, v)| k == "store.url" && v.starts_with("file://"))
            {
                all.retain(|(k, _)| !k.starts_with("store."));
            }
            all.extend(source.keys.iter().cloned());
            let args = vec![
                "--data-dir".to_string(),
                target.to_string_lossy().into_owned(),
                "--etcd-bin".into(),
                bin.clone(),
                "--to-revision".into(),
                r.to_string(),
            ];
            let (ok, said) = super::faultrun::cli_output(all.clone(), "restore".into(), args).await;
            let what = format!(
                "{} chain of {} ({} deltas to revision {chain_end}): restore --to-revision {r}",
                source.label,
                chain.full.snap_name,
                chain.deltas.len(),
            );
            if !ok {
                let _ = std::fs::remove_dir_all(target.parent().unwrap_or(&target));
                // A full snapshot holds the writes that raced it (etcd serves while it
                // streams), so its database may go past the revision in its name; the
                // restore refuses a target before that, saying where it holds. Judged
                // there instead, once (the refusal itself is the documented answer).
                if r == chosen
                    && let Some(held) = raced_to(&said, r)
                {
                    out.raced += 1;
                    if held <= chain_end && model.knows(held) {
                        r = held;
                        continue;
                    }
                    // Past the chain's last delta (a final taken after etcd's kill, leases
                    // expiring): no target in the chain reaches it, so the full snapshot is
                    // judged alone where its database holds.
                    let alone = Alone {
                        source,
                        full: chain.full,
                        held,
                        keys: &all,
                        bin: &bin,
                        dir,
                    };
                    if let Err(v) = alone.judge(model, prefix, release).await {
                        out.violations.push(format!("{what}: {v}"));
                    }
                    return;
                }
                // Retention may delete an old chain while it is restored: not a defect, once
                // the store, listed again, shows a snapshot it needed gone.
                let tail: Vec<&str> = said.lines().rev().take(4).collect();
                let wanted = needed(chain, r);
                match source.store.list().await {
                    Ok(now) => match gone_by_retention(&wanted, &now, &said) {
                        Some(missing) => out
                            .gone
                            .push(format!("{what}: {} deleted meanwhile", missing.join(", "))),
                        None => out.violations.push(format!(
                            "{what} failed with every snapshot it needs still listed ({}): {}",
                            wanted.join(", "),
                            tail.join(" | ")
                        )),
                    },
                    Err(e) => out.violations.push(format!(
                        "{what} failed, and the store could not be listed again ({e}): {}",
                        tail.join(" | ")
                    )),
                }
                return;
            }
            match read(release, &target, prefix).await {
                Ok(got) => {
                    let want = model.state_at(prefix, r);
                    let diff = differences(&want, &got);
                    if !diff.is_empty() {
                        out.violations.push(format!(
                            "{what}: {} keys differ from the history, e.g. {}",
                            diff.len(),
                            diff.iter().take(3).cloned().collect::<Vec<_>>().join("; ")
                        ));
                    }
                }
                Err(e) => out
                    .violations
                    .push(format!("{what}: the restored etcd did not answer: {e}")),
            }
            let _ = std::fs::remove_dir_all(target.parent().unwrap_or(&target));
            return;
        }
    }
}

/// A full snapshot judged alone at the revision its database holds: copied by itself into a
/// store on disk, restored without a target (so, whole), and compared with the model there.
struct Alone<'a> {
    source: &'a Source,
    full: &'a Snapshot,
    held: i64,
    keys: &'a [(String, String)],
    bin: &'a str,
    dir: &'a Path,
}

impl Alone<'_> {
    async fn judge(&self, model: &RevModel, prefix: &str, release: Release) -> Result<(), String> {
        use futures::TryStreamExt as _;
        let held = self.held;
        if !model.knows(held) {
            return Err(format!(
                "its database holds revision {held}, which the history does not know (to {})",
                model.complete_to
            ));
        }
        let root = self.dir.join(format!("{}-alone-{held}", self.source.label));
        let store_dir = root.join("store");
        let layout = store_dir.join("v2");
        std::fs::create_dir_all(&layout).map_err(|e| format!("{}: {e}", layout.display()))?;
        let stream = self
            .source
            .store
            .get_stream(self.full)
            .await
            .map_err(|e| format!("reading {} to judge it alone: {e}", self.full.snap_name))?;
        let chunks: Vec<bytes::Bytes> = stream
            .try_collect()
            .await
            .map_err(|e| format!("reading {} to judge it alone: {e}", self.full.snap_name))?;
        std::fs::write(layout.join(&self.full.snap_name), chunks.concat())
            .map_err(|e| format!("{}: {e}", layout.display()))?;
        let mut keys: Vec<(String, String)> = self
            .keys
            .iter()
            .filter(|(k, _)| !k.starts_with("store."))
            .cloned()
            .collect();
        keys.push((
            "store.url".into(),
            format!("file://{}", store_dir.display()),
        ));
        let target = root.join("data");
        let args = vec![
            "--data-dir".to_string(),
            target.to_string_lossy().into_owned(),
            "--etcd-bin".into(),
            self.bin.to_string(),
        ];
        let (ok, said) = super::faultrun::cli_output(keys, "restore".into(), args).await;
        let result = match ok {
            false => {
                let tail: Vec<&str> = said.lines().rev().take(4).collect();
                Err(format!(
                    "its raced writes put the target out of reach, and restored alone it failed: {}",
                    tail.join(" | ")
                ))
            }
            true => match read(release, &target, prefix).await {
                Ok(got) => {
                    let diff = differences(&model.state_at(prefix, held), &got);
                    match diff.is_empty() {
                        true => Ok(()),
                        false => Err(format!(
                            "restored alone at revision {held}, {} keys differ from the history, \
                             e.g. {}",
                            diff.len(),
                            diff.iter().take(3).cloned().collect::<Vec<_>>().join("; ")
                        )),
                    }
                }
                Err(e) => Err(format!("restored alone, the etcd did not answer: {e}")),
            },
        };
        let _ = std::fs::remove_dir_all(&root);
        result
    }
}

/// Starts etcd on a restored data directory and reads every key under `prefix`.
async fn read(
    release: Release,
    data_dir: &Path,
    prefix: &str,
) -> Result<BTreeMap<String, KeyState>, String> {
    let etcd = super::etcd::temp_etcd(release, data_dir, "default", data_dir.with_extension("log"))
        .await?;
    let got = async {
        let client = etcd_client::Client::connect([&etcd.client_url], None)
            .await
            .map_err(|e| e.to_string())?;
        let r = client
            .kv_client()
            .max_decoding_message_size(1 << 30)
            .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
            .await
            .map_err(|e| e.to_string())?;
        Ok::<_, String>(
            r.kvs()
                .iter()
                .map(|kv| {
                    (
                        String::from_utf8_lossy(kv.key()).into_owned(),
                        KeyState {
                            id: super::kvcheck::id_of(kv.value()).unwrap_or_else(|| {
                                format!("<not a traffic value, {} bytes>", kv.value().len())
                            }),
                            create_revision: kv.create_revision(),
                            mod_revision: kv.mod_revision(),
                            version: kv.version(),
                        },
                    )
                })
                .collect(),
        )
    }
    .await;
    let _ = etcd.stop().await;
    got
}

/// Deltas that do not follow their predecessor in a chain. A gap is excused only when a store
/// fault (`store_faults`, times from `wall_epoch`) overlaps the time between the predecessor and
/// the delta (when the missing delta would have been stored; snapshot times are whole seconds,
/// hence a second either side), and then the snapshot after the delta is a full one.
pub fn gaps(
    snapshots: &[Snapshot],
    store_faults: &[(Duration, Duration)],
    wall_epoch: SystemTime,
) -> Vec<String> {
    let at = |s: &Snapshot| {
        SystemTime::from(s.created_on)
            .duration_since(wall_epoch)
            .unwrap_or_default()
    };
    let mut sorted: Vec<&Snapshot> = snapshots.iter().collect();
    sorted.sort_by_key(|s| (s.last_revision, s.kind != Kind::Full, s.start_revision));
    let mut out = Vec::new();
    let mut prev: Option<&Snapshot> = None;
    for (n, s) in sorted.iter().enumerate() {
        if s.kind == Kind::Full {
            prev = Some(s);
            continue;
        }
        if let Some(p) = prev
            && s.start_revision > p.last_revision + 1
        {
            let (from, to) = (
                at(p).saturating_sub(Duration::from_secs(1)),
                at(s) + Duration::from_secs(1),
            );
            let faulted = store_faults.iter().any(|(a, b)| *a <= to && *b >= from);
            let full_next = sorted.get(n + 1).is_some_and(|x| x.kind == Kind::Full);
            if !(faulted && full_next) {
                out.push(format!(
                    "{} starts at revision {} after {} ended at {}: a gap between {:.0}s and \
                     {:.0}s ({}; {})",
                    s.snap_name,
                    s.start_revision,
                    p.snap_name,
                    p.last_revision,
                    from.as_secs_f64(),
                    to.as_secs_f64(),
                    if faulted {
                        "a store fault covers it"
                    } else {
                        "no store fault covers it"
                    },
                    if full_next {
                        "a full follows"
                    } else {
                        "no full follows it"
                    }
                ));
            }
        }
        prev = Some(s);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::{TimeZone, Utc};
    use etcd_warden::store::Codec;

    fn snap(kind: Kind, start: i64, last: i64, secs: i64) -> Snapshot {
        let created_on = Utc.timestamp_opt(1_000_000 + secs, 0).unwrap();
        let mut s = Snapshot {
            kind,
            snap_name: String::new(),
            prefix: "etcd/v2/".into(),
            compression: Codec::Gzip,
            start_revision: start,
            last_revision: last,
            created_on,
            is_final: false,
            encrypted: false,
        };
        s.snap_name = format!("{kind:?}-{start}-{last}");
        s
    }

    fn epoch() -> SystemTime {
        SystemTime::from(Utc.timestamp_opt(1_000_000, 0).unwrap())
    }

    #[test]
    fn revisions_are_chosen_per_chain_with_its_first_and_last_boundary() {
        let list = vec![
            snap(Kind::Full, 0, 10, 0),
            snap(Kind::Incr, 11, 20, 2),
            snap(Kind::Incr, 21, 30, 4),
            snap(Kind::Incr, 31, 40, 6),
            snap(Kind::Full, 0, 45, 8),
            snap(Kind::Incr, 46, 50, 10),
        ];
        let cs = chains(&list);
        assert_eq!(cs.len(), 2);
        assert_eq!(cs[0].deltas.len(), 3);
        let mut rng = SplitMix64::new(7);
        let r = choose(&cs[0], 5, &mut rng, |_| true);
        assert_eq!(r.len(), 5);
        assert!(
            r.contains(&20) && r.contains(&40) && r.contains(&10),
            "{r:?}"
        );
        assert!(r.iter().all(|r| (10..=40).contains(r)));
        // Only what the model knows.
        let r = choose(&cs[0], 5, &mut rng, |r| r <= 25);
        assert!(r.iter().all(|r| *r <= 25) && r.contains(&20), "{r:?}");
    }

    #[test]
    fn a_delta_the_full_covers_is_not_in_its_chain() {
        // Two snapshot leaders overlapped: a delta to the full's own revision was stored
        // before the full (finding 12 of docs/robustness.md, seed 0x5001).
        let list = vec![
            snap(Kind::Incr, 4195, 4271, 0),
            snap(Kind::Full, 0, 4271, 2),
            snap(Kind::Incr, 4272, 4353, 4),
            snap(Kind::Incr, 4354, 4464, 6),
        ];
        let cs = chains(&list);
        assert_eq!(cs.len(), 1);
        let names: Vec<&str> = cs[0].deltas.iter().map(|d| d.snap_name.as_str()).collect();
        assert_eq!(names, ["Incr-4272-4353", "Incr-4354-4464"]);
    }

    #[test]
    fn a_drill_is_judged_no_later_than_its_chain_names() {
        // etcd served 19883 from a full named 19882 (raced writes): judged at 19882.
        assert_eq!(
            super::drill_target(19882, 19883, Some(19882), |_| true),
            Some(19882)
        );
        // Within the chain: at what etcd served, or the newest revision the history knows.
        assert_eq!(super::drill_target(10, 35, Some(40), |_| true), Some(35));
        assert_eq!(super::drill_target(10, 35, Some(40), |r| r <= 30), Some(30));
        assert_eq!(super::drill_target(10, 35, None, |_| true), Some(35));
        // The history ends before the chain: unjudged.
        assert_eq!(super::drill_target(10, 35, Some(40), |r| r < 10), None);
    }

    #[test]
    fn a_gap_is_excused_only_by_a_store_fault_and_a_full_after_it() {
        let gapped = vec![
            snap(Kind::Full, 0, 10, 0),
            snap(Kind::Incr, 11, 20, 2),
            snap(Kind::Incr, 25, 30, 10),
        ];
        let fault = [(Duration::from_secs(5), Duration::from_secs(7))];
        let elsewhere = [(Duration::from_secs(50), Duration::from_secs(60))];
        assert_eq!(gaps(&gapped, &[], epoch()).len(), 1);
        assert_eq!(gaps(&gapped, &fault, epoch()).len(), 1, "no full follows");
        let mut healed = gapped.clone();
        healed.push(snap(Kind::Full, 0, 31, 12));
        assert!(gaps(&healed, &fault, epoch()).is_empty());
        assert_eq!(gaps(&healed, &elsewhere, epoch()).len(), 1);
        let whole = vec![snap(Kind::Full, 0, 10, 0), snap(Kind::Incr, 11, 20, 2)];
        assert!(gaps(&whole, &[], epoch()).is_empty());
    }

    #[test]
    fn a_target_before_a_full_snapshots_raced_writes_is_judged_where_it_holds() {
        let said = "etcd-warden: restore failed while writing the deltas into the database: the \
                    full snapshot's database holds revisions up to 2325 (writes that raced the \
                    snapshot), beyond the target revision 2323; choose a target at or after 2325";
        assert_eq!(super::raced_to(said, 2323), Some(2325));
        // Another target's refusal, another failure, or nothing past the target: judged as failed.
        assert_eq!(super::raced_to(said, 2300), None);
        assert_eq!(
            super::raced_to("events out of order: revision 1652 after 1813", 1652),
            None
        );
        let not_past = said.replace("up to 2325", "up to 2323");
        assert_eq!(super::raced_to(&not_past, 2323), None);
    }

    #[test]
    fn a_passed_drill_is_read_from_what_verify_printed() {
        let said = "2026-12-02T18:20:43Z  INFO drill: …\n\
                    ok    restore drill: Full-00000000-00001709-1796235548.gz.final and 3 deltas \
                    restored in 1.2s; etcd serves revision 1757, 540 keys, sha256 ab12 (checked \
                    in 0.3s)\n";
        assert_eq!(
            passed_drill(said),
            Some(PassedDrill {
                full: "Full-00000000-00001709-1796235548.gz.final".into(),
                deltas: 3,
                revision: 1757,
            })
        );
        assert_eq!(
            passed_drill("FAIL  restore drill: the restore failed: …"),
            None
        );
        assert_eq!(passed_drill(""), None);
    }

    #[test]
    fn a_failure_is_retentions_only_when_a_needed_snapshot_is_gone_and_the_failure_says_so() {
        let s = |name: &str| {
            Snapshot::parse_name("p", name).unwrap_or_else(|e| panic!("{name}: {e:?}"))
        };
        let full = s("Full-00000000-00001698-1764683000.gz");
        let d1 = s("Incr-00001699-00001750-1764683010.gz");
        let d2 = s("Incr-00001751-00001800-1764683020.gz");
        let chain = Chain {
            full: &full,
            deltas: vec![&d1, &d2],
        };
        // Revision 1749 reads the full snapshot and the first delta only.
        let wanted = needed(&chain, 1749);
        assert_eq!(wanted, [full.snap_name.clone(), d1.snap_name.clone()]);
        assert_eq!(needed(&chain, 1698), std::slice::from_ref(&full.snap_name));
        let gap = "restore failed while checking the chain: revision gap in the latest chain: \
                   revisions 1646 to 4225 are in no snapshot";
        // Finding 8's shape: the chain's deltas were deleted before the restore listed.
        assert_eq!(
            gone_by_retention(&wanted, std::slice::from_ref(&full), gap),
            Some(vec![d1.snap_name.clone()])
        );
        // Everything still listed: a defect, whatever the failure says.
        let all = [full.clone(), d1.clone(), d2.clone()];
        assert_eq!(gone_by_retention(&wanted, &all, gap), None);
        assert_eq!(gone_by_retention(&wanted, &all, "object not found"), None);
        // A deletion of a snapshot the restore did not need excuses nothing.
        assert_eq!(
            gone_by_retention(&wanted, &[full.clone(), d1.clone()], gap),
            None
        );
        // Gone, but the restore failed otherwise: judged as failed.
        assert_eq!(
            gone_by_retention(
                &wanted,
                std::slice::from_ref(&full),
                "events out of order: revision 1652 after 1813"
            ),
            None
        );
    }

    #[test]
    fn a_restored_key_differing_in_any_field_is_found() {
        let k = |id: &str, c, m, v| KeyState {
            id: id.into(),
            create_revision: c,
            mod_revision: m,
            version: v,
        };
        let want: BTreeMap<String, KeyState> = [("/a".to_string(), k("x", 2, 5, 3))].into();
        assert!(differences(&want, &want.clone()).is_empty());
        let wrong: BTreeMap<String, KeyState> = [("/a".to_string(), k("x", 2, 5, 1))].into();
        assert_eq!(differences(&want, &wrong).len(), 1);
        let extra: BTreeMap<String, KeyState> = [
            ("/a".to_string(), k("x", 2, 5, 3)),
            ("/b".to_string(), k("y", 6, 6, 1)),
        ]
        .into();
        assert_eq!(differences(&want, &extra).len(), 1);
        assert_eq!(differences(&want, &BTreeMap::new()).len(), 1);
    }
}
