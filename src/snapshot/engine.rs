//! The production [`Engine`]: etcd's snapshot and watch APIs on one side, the store on the other.

use crate::etcd::RotatingClient;
use async_trait::async_trait;
use chrono::{DateTime, Utc};

use std::time::{Duration, Instant};

use super::actor::{
    Collected, DefragStep, Engine, EngineError, FullKind, Membership, StepOutcome, Stored,
};
use super::defrag::{self, DefragPlan, MemberState, PassState, Rule};
use super::delta::DeltaWriter;
use super::full::{Target, take_full_as};
use super::watcher::{DeltaWatch, WatchError};
use crate::store::gc::{self, GcReport, Retention};
use crate::store::{Chain, Codec, SnapshotStore};

/// Snapshots of the etcd member `etcd` talks to, stored in `store`.
pub struct EtcdEngine {
    etcd: RotatingClient,
    store: SnapshotStore,
    codec: Codec,
    retention: Retention,
    /// Regular work wants deltas (between `resume` and `pause`).
    want_deltas: bool,
    /// Events since the latest stored snapshot; `None` until a base snapshot exists.
    writer: Option<DeltaWriter>,
    watch: Option<DeltaWatch>,
    /// `resume` found etcd behind the store and set the store's newer history aside.
    base_needed: bool,
}

impl EtcdEngine {
    /// etcd is at `revision`, the store reaches `store_last`: every snapshot after `revision`
    /// is moved out of the layout (kept under `etcd-warden/diverged/`), so no restore joins
    /// the two histories and no delta of etcd's new writes is skipped as already stored; a full
    /// snapshot is then due at once and starts the watch.
    async fn set_history_aside(
        &mut self,
        revision: i64,
        store_last: i64,
    ) -> Result<(), EngineError> {
        let label = format!("{}-etcd-at-{revision}", Utc::now().format("%Y%m%dT%H%M%SZ"));
        tracing::error!(
            etcd_revision = revision,
            store_revision = store_last,
            aside = %self.store.aside_prefix(&label),
            "etcd is behind the store's newest snapshot: it was restored to an older state; the store's snapshots after its revision are set aside and a full snapshot starts a new base"
        );
        let newer: Vec<_> = self
            .store
            .list()
            .await?
            .into_iter()
            .filter(|s| s.last_revision > revision)
            .collect();
        for snapshot in &newer {
            self.store.set_aside(snapshot, &label).await?;
            tracing::warn!(snapshot = %snapshot.snap_name, "set aside");
        }
        self.base_needed = true;
        Ok(())
    }

    /// An engine over a client of the local member only (leadership is judged by it).
    pub fn new(
        etcd: RotatingClient,
        store: SnapshotStore,
        codec: Codec,
        retention: Retention,
    ) -> Self {
        EtcdEngine {
            etcd,
            store,
            codec,
            retention,
            want_deltas: false,
            writer: None,
            watch: None,
            base_needed: false,
        }
    }

    /// Starts a writer and a watch continuing after revision `last`.
    async fn watch_after(&mut self, last: i64) -> Result<(), EngineError> {
        let client = self.etcd.client().await;
        self.watch = Some(DeltaWatch::open(&client, last + 1).await?);
        self.writer = Some(DeltaWriter::new(self.codec, last));
        tracing::debug!(from_revision = last + 1, "watching etcd for deltas");
        Ok(())
    }
}

#[async_trait]
impl Engine for EtcdEngine {
    async fn full(&mut self, kind: &FullKind) -> Result<Stored, EngineError> {
        let client = self.etcd.client().await;
        let (snap, bytes) = match kind {
            FullKind::Regular => {
                take_full_as(&client, &self.store, Target::Regular(self.codec)).await?
            }
            FullKind::Requested | FullKind::RequestedFinal => {
                let target = if matches!(kind, FullKind::RequestedFinal) {
                    Target::RequestedFinal(self.codec)
                } else {
                    Target::Regular(self.codec)
                };
                let (snap, bytes) = take_full_as(&client, &self.store, target).await?;
                // After the snapshot (retention deletes a marker whose snapshot is not listed),
                // before the actor answers and runs its next retention pass. Unmarked, it counts
                // as scheduled: said loudly, the snapshot itself stands.
                if let Err(e) = gc::mark_triggered(&self.store, &snap).await {
                    tracing::error!(snapshot = %snap.snap_name, error = %e, "cannot mark a requested full snapshot as requested; retention counts it as scheduled");
                }
                (snap, bytes)
            }
            FullKind::Final { name, min_revision } => {
                let target = Target::Final {
                    name,
                    min_revision: *min_revision,
                };
                take_full_as(&client, &self.store, target).await?
            }
        };
        let is_final = snap.is_final;
        let requested = matches!(kind, FullKind::Requested | FullKind::RequestedFinal);
        self.base_needed = false;
        match self.writer.as_mut() {
            // A requested full snapshot is one more restore point, not a new base: the deltas
            // go on as if it had not been taken, so the scheduled chain it falls in stays whole
            // when retention deletes the request (`gc::plan_with`; the first delta after it
            // overlaps it, which a restore from it passes over).
            Some(_) if requested => {}
            // The running watch goes on; what the full snapshot covers is dropped.
            Some(w) => w.rebase(snap.last_revision),
            // A request (druid's requested final too) is followed by deltas, as
            // etcd-backup-restore's final taken over HTTP is; the hand-off's final is not.
            None if self.want_deltas && (requested || !is_final) => {
                self.watch_after(snap.last_revision).await?
            }
            None => {}
        }
        Ok(Stored {
            snapshot: snap,
            bytes,
        })
    }

    async fn collect(&mut self) -> Result<Collected, EngineError> {
        let (Some(watch), Some(writer)) = (self.watch.as_mut(), self.writer.as_mut()) else {
            // Nothing to watch until a base snapshot exists: wait for the actor to take one.
            std::future::pending::<()>().await;
            return Ok(Collected::Events);
        };
        match watch.next().await {
            Ok(mut events) => {
                // Planted (`crate::plant`): the first event of each revision only.
                if crate::plant::active("delta-first-event-only") {
                    events.dedup_by_key(|e| e.revision());
                }
                // Planted: 1 KiB leaked per buffered event, touched so that it is resident.
                if crate::plant::active("delta-leak") {
                    for _ in &events {
                        std::mem::forget(vec![0x5au8; 1024]);
                    }
                }
                writer.push(events, Utc::now());
                Ok(Collected::Events)
            }
            Err(WatchError::Compacted { wanted, compacted }) => {
                tracing::warn!(
                    wanted,
                    compacted,
                    "etcd compacted past the delta stream; a full snapshot is needed"
                );
                self.watch = None;
                self.writer = None;
                Ok(Collected::Compacted)
            }
            Err(e) => {
                self.watch = None;
                Err(e.into())
            }
        }
    }

    fn buffered_bytes(&self) -> u64 {
        self.writer
            .as_ref()
            .map_or(0, |w| w.buffered_bytes() as u64)
    }

    async fn flush_delta(&mut self) -> Result<Option<Stored>, EngineError> {
        match self.writer.as_mut() {
            Some(w) => Ok(w
                .flush_sized(&self.store)
                .await?
                .map(|(snapshot, bytes)| Stored { snapshot, bytes })),
            None => Ok(None),
        }
    }

    async fn resume(&mut self) -> Result<(), EngineError> {
        self.want_deltas = true;
        self.watch = None;
        self.writer = None;
        let chain = self.store.latest_chain().await?;
        let last = chain
            .delta_snapshots
            .iter()
            .chain(chain.full_snapshot.iter())
            .map(|s| s.last_revision)
            .max();
        let Some(last) = last else {
            // No base yet: the first full snapshot starts the watch.
            return Ok(());
        };
        // The cluster's revision, read linearizably (a member still catching up answers with
        // the cluster's): below the store's newest, etcd was restored to an older state, and
        // the store's snapshots after its revision belong to a history etcd no longer has.
        let mut client = self.etcd.client().await;
        let revision = client
            .get(
                "\0",
                Some(
                    etcd_client::GetOptions::new()
                        .with_keys_only()
                        .with_limit(1),
                ),
            )
            .await?
            .header()
            .map_or(0, |h| h.revision());
        if revision < last {
            self.set_history_aside(revision, last).await?;
            return Ok(());
        }
        self.watch_after(last).await
    }

    fn base_needed(&self) -> bool {
        self.base_needed
    }

    fn pause(&mut self) {
        self.want_deltas = false;
        self.watch = None;
        self.writer = None;
    }

    async fn membership(&mut self) -> Result<Membership, EngineError> {
        let mut client = self.etcd.client().await;
        let status = client.status().await?;
        let me = status.header().map(|h| h.member_id()).unwrap_or_default();
        // Both are unary calls, bounded by etcd.request_timeout. A learner may be refused the
        // member list; its size is then unknown, which is no reason to doubt the status.
        let cluster_size = match client.member_list().await {
            Ok(list) => Some(list.members().len() as u64),
            Err(error) => {
                tracing::debug!(%error, "reading etcd's member list failed");
                None
            }
        };
        Ok(Membership {
            leader: me != 0 && status.leader() == me,
            learner: status.is_learner(),
            cluster_size,
        })
    }

    async fn latest_chain(&mut self) -> Result<Chain, EngineError> {
        Ok(self.store.latest_chain().await?)
    }

    async fn gc(&mut self, now: DateTime<Utc>) -> Result<GcReport, EngineError> {
        Ok(gc::run(&self.store, now, self.retention).await?)
    }

    async fn defrag_step(
        &mut self,
        pass: &PassState,
        rule: Rule,
        timeout: Duration,
    ) -> Result<StepOutcome, EngineError> {
        let mut client = self.etcd.client().await;
        let me = client
            .status()
            .await?
            .header()
            .map(|h| h.member_id())
            .unwrap_or_default();
        let base = self.etcd.config().clone();
        let members = member_states(&base, &mut client).await?;
        let step = match defrag::plan(&members, me, pass, &rule) {
            DefragPlan::Stop { reason, detail } => DefragStep::Stopped { reason, detail },
            DefragPlan::Done => DefragStep::Done,
            // Planted (`crate::plant`): the leader defragmented where it should hand over.
            DefragPlan::MoveLeader { from, .. } if crate::plant::active("defrag-leader") => {
                defragment(&base, &members, from, timeout).await?
            }
            DefragPlan::MoveLeader { from, to } => {
                move_leader(&base, &members, from, to, timeout).await?;
                DefragStep::MovedLeader { from, to }
            }
            DefragPlan::Defragment(id) => defragment(&base, &members, id, timeout).await?,
        };
        Ok(StepOutcome {
            observed: members,
            step,
        })
    }
}

/// Every member's state, each from its own status.
async fn member_states(
    base: &crate::config::EtcdConfig,
    client: &mut etcd_client::Client,
) -> Result<Vec<MemberState>, EngineError> {
    let list = client.member_list().await?;
    let mut members = Vec::new();
    for m in list.members() {
        members.push(member_state(base, m.id(), m.client_urls(), m.is_learner()).await);
    }
    Ok(members)
}

/// A client to `member` alone, whose requests may take `timeout` (as long as a defragmentation).
async fn client_of(
    base: &crate::config::EtcdConfig,
    member: &MemberState,
    timeout: Duration,
) -> Result<etcd_client::Client, EngineError> {
    let config = crate::config::EtcdConfig {
        endpoints: member.client_urls.clone(),
        request_timeout: timeout,
        ..base.clone()
    };
    Ok(crate::etcd::connect(&config).await?)
}

/// Moves leadership from `from` to `to` (etcd accepts MoveLeader only at the leader), then waits
/// until every voting member answers healthy (knows a leader) and `to` is the one whose status
/// says it leads, so the next plan does not see the election half-way (two or no leaders).
async fn move_leader(
    base: &crate::config::EtcdConfig,
    members: &[MemberState],
    from: u64,
    to: u64,
    timeout: Duration,
) -> Result<(), EngineError> {
    let Some(leader) = members.iter().find(|m| m.id == from) else {
        return Ok(());
    };
    tracing::info!(
        from = format_args!("{from:x}"),
        to = format_args!("{to:x}"),
        "moving leadership before defragmenting the leader"
    );
    client_of(base, leader, timeout)
        .await?
        .move_leader(to)
        .await?;
    // Bounded by the step's own bound (`defrag.timeout`) in the actor.
    loop {
        let mut agreed = true;
        for m in members {
            if m.is_learner {
                continue;
            }
            let s = member_state(base, m.id, &m.client_urls, m.is_learner).await;
            agreed &= s.healthy && s.is_leader == (m.id == to);
        }
        if agreed {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Defragments member `id`, unless its own status, read right before, says it leads while
/// other members vote: leadership moved to it since the plan, which must be made again.
async fn defragment(
    base: &crate::config::EtcdConfig,
    members: &[MemberState],
    id: u64,
    timeout: Duration,
) -> Result<DefragStep, EngineError> {
    let Some(member) = members.iter().find(|m| m.id == id) else {
        return Ok(DefragStep::LeaderMoved);
    };
    let mut one = client_of(base, member, timeout).await?;
    let leader = one.status().await?.leader();
    let voters = members.iter().filter(|m| !m.is_learner).count();
    if leader == id && voters > 1 && !crate::plant::active("defrag-leader") {
        tracing::info!(
            member = format_args!("{id:x}"),
            "the member took leadership since the plan; planning again"
        );
        return Ok(DefragStep::LeaderMoved);
    }
    tracing::info!(
        member = format_args!("{:x}", member.id),
        leader = format_args!("{leader:x}"),
        db_size = member.db_size,
        db_size_in_use = member.db_size_in_use,
        "defragmenting"
    );
    let started = Instant::now();
    one.defragment().await?;
    let took = started.elapsed();
    let db_size_after = one.status().await.ok().map(|s| s.db_size());
    Ok(DefragStep::Defragmented {
        member: member.id,
        leader,
        db_size_before: member.db_size,
        db_size_after,
        took,
    })
}

/// A member's state from its own status (a client to its URLs alone); unhealthy when it does not
/// answer, reports an error other than running out of space (which defragmentation is for), or
/// knows no leader.
async fn member_state(
    base: &crate::config::EtcdConfig,
    id: u64,
    client_urls: &[String],
    is_learner: bool,
) -> MemberState {
    let mut state = MemberState {
        id,
        client_urls: client_urls.to_vec(),
        is_leader: false,
        is_learner,
        db_size: 0,
        db_size_in_use: 0,
        raft_index: 0,
        healthy: false,
    };
    let config = crate::config::EtcdConfig {
        endpoints: client_urls.to_vec(),
        ..base.clone()
    };
    if client_urls.is_empty() {
        return state;
    }
    let status = match crate::etcd::connect(&config).await {
        Ok(mut c) => c.status().await,
        Err(error) => {
            tracing::debug!(%error, member = format_args!("{id:x}"), "no client to member");
            return state;
        }
    };
    match status {
        Ok(s) => {
            state.is_leader = s.leader() == id;
            state.db_size = s.db_size();
            state.db_size_in_use = s.raft_used_db_size();
            state.raft_index = s.raft_index();
            state.healthy = s.leader() != 0 && s.errors().iter().all(|e| e.contains("NOSPACE"));
        }
        Err(error) => {
            tracing::debug!(%error, member = format_args!("{id:x}"), "member status failed")
        }
    }
    state
}
