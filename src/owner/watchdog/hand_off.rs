//! The watchdog's hand-off actions: the start check, the fence marker, and the take phase's
//! calls (check, read the revision, create a claim, create the intent, take the final, write the
//! record), each one call to etcd or the store whose result the protocol gets back as an event.

use std::time::Duration;

use chrono::Utc;
use tokio::time::Instant;

use super::{Driver, SeamError};
use crate::owner::handoff::{
    self, Claim, ClusterView, Decision, FenceMarker, FinalIntent, HandOffError, HandOffRecord,
    KilledProcess, Member,
};
use crate::owner::protocol::{HandOff, StartCheck};
use crate::store::Snapshot;

/// The stored final a hand-off record is written for.
#[derive(Clone)]
pub(super) struct ToRecord {
    final_snapshot: Snapshot,
    /// The revision every member's fence froze (the intent's).
    revision: i64,
    /// The members to name; read when the record is written if `None`.
    members: Option<Vec<Member>>,
}

impl Driver<'_> {
    pub(super) async fn start_check(&mut self) -> StartCheck {
        let span = tracing::info_span!("start_check", owner_id = %self.config.owner_id);
        let result = tracing::Instrument::instrument(self.fenced_at_start(), span.clone()).await;
        let _in = span.enter();
        match result {
            Ok(None) => {
                self.succeed();
                StartCheck::Clear
            }
            Ok(Some(why)) => {
                tracing::warn!(reason = %why, "this member was handed off earlier and stays fenced; `etcd-warden reclaim` undoes it");
                self.fail(&why);
                StartCheck::Fenced
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot check the store for an earlier hand-off; not becoming Active");
                self.fail(&format!("start check: {e}"));
                StartCheck::Failed
            }
        }
    }

    /// `Some(why)` when an earlier hand-off fenced this member.
    async fn fenced_at_start(&mut self) -> Result<Option<String>, SeamError> {
        let me = self.member().await?;
        let objects = &self.ctx.objects;
        let own = match objects.fence(me).await {
            Ok(own) => own,
            // Only a hand-off writes this member's marker, so one that is there but unreadable
            // (truncated, edited by hand) still says "handed off": failing closed means counting
            // it, not retrying a check that can never succeed while a destination may be live.
            Err(HandOffError::Unreadable { key, source }) => {
                return Ok(Some(format!(
                    "the store holds this member's fence marker {key}, unreadable ({source}): counted as fenced"
                )));
            }
            Err(e) => return Err(e.into()),
        };
        let record = objects.record().await?;
        let latest = objects.latest_full().await?;
        let revision = match &latest {
            Some(s) if s.is_final => self.ctx.etcd.revision().await?,
            _ => i64::MAX,
        };
        if !handoff::fenced_at_start(own.is_some(), record.is_some(), latest.as_ref(), revision) {
            return Ok(None);
        }
        Ok(Some(match (own, record, latest) {
            (Some(m), _, _) => format!(
                "the store holds this member's fence marker ({} at {})",
                m.reason, m.fenced_at
            ),
            (_, Some(r), _) => format!(
                "the store records a hand-off with final {}",
                r.final_snapshot
            ),
            (_, _, Some(s)) => format!(
                "the store's latest full snapshot {} is final at etcd's revision {revision}",
                s.snap_name
            ),
            _ => "fenced".into(),
        }))
    }

    pub(super) async fn write_fence(&mut self) -> bool {
        let result = async {
            let me = self.member().await?;
            let marker = FenceMarker {
                member_id: format!("{me:x}"),
                owner_id: self.config.owner_id.clone(),
                reason: self.last_verdict.clone(),
                killed: self
                    .killed
                    .iter()
                    .map(|p| KilledProcess {
                        pid: p.pid,
                        start_time: p.start_time,
                    })
                    .collect(),
                fenced_at: Utc::now(),
            };
            self.ctx.objects.write_fence(me, &marker).await?;
            Ok::<_, SeamError>(me)
        }
        .await;
        match result {
            Ok(me) => {
                tracing::info!(member_id = %format!("{me:x}"), owner_id = %self.config.owner_id, "fence marker stored");
                self.succeed();
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot store the fence marker; retrying");
                self.fail(&format!("fence marker: {e}"));
                false
            }
        }
    }

    /// `Action::CheckHandOff`: reads the cluster (with the revision this check read, if it
    /// did) and answers with `handoff::decide`'s decision. Keeps what later actions need: the
    /// intent to take, the stored final to record.
    pub(super) async fn check_hand_off(&mut self, revision: Option<i64>) -> HandOff {
        let span = self.hand_off_span();
        let result = tracing::Instrument::instrument(self.decide(revision), span.clone()).await;
        let _in = span.enter();
        match result {
            Ok((Decision::Done(done), true)) => {
                self.succeed();
                self.status.send_modify(|s| {
                    s.final_snapshot = Some(done.snap_name.clone());
                    s.waiting_for.clear();
                });
                HandOff::Done
            }
            Ok((Decision::Done(done), false)) => {
                tracing::info!(snapshot = %done.snap_name, "the hand-off's final snapshot is in the store");
                HandOff::Stored
            }
            Ok((Decision::Take(intent), _)) => {
                self.status.send_modify(|s| {
                    s.waiting_for.clear();
                    s.final_snapshot = None;
                });
                HandOff::Take {
                    min_revision: intent.revision,
                }
            }
            Ok((Decision::WaitMembers(left), _)) => {
                tracing::info!(members = ?left, "waiting for every member to be fenced before the final snapshot");
                self.succeed();
                self.status.send_modify(|s| s.waiting_for = left);
                HandOff::Wait
            }
            Ok((Decision::WaitTaker { taker, takeover_in }, _)) => {
                tracing::debug!(%taker, ?takeover_in, "waiting for the member that takes the final snapshot");
                self.succeed();
                self.status.send_modify(|s| {
                    s.waiting_for = vec![format!(
                        "{taker} (takes the final snapshot; this member takes over in {}s unless it is stored)",
                        takeover_in.as_secs()
                    )]
                });
                HandOff::Wait
            }
            Ok((Decision::NeedRevision, _)) => HandOff::NeedRevision,
            Ok((Decision::Claim { epoch }, _)) => HandOff::Claim { epoch },
            Ok((Decision::FixIntent { revision }, _)) => HandOff::FixIntent { revision },
            Err(e) => {
                self.check_failed(&e);
                HandOff::Failed
            }
        }
    }

    fn hand_off_span(&self) -> tracing::Span {
        let member_id = self.member_id.map(|id| format!("{id:x}"));
        tracing::info_span!("hand_off", owner_id = %self.config.owner_id, member_id = member_id.as_deref())
    }

    /// A call of the hand-off check failed: logged, shown, and the protocol backs off.
    fn check_failed(&self, e: &SeamError) {
        tracing::warn!(error = %e, "the hand-off check failed; retrying");
        self.fail(&format!("hand-off check: {e}"));
    }

    /// One view of the cluster and the decision on it; also whether the hand-off record already
    /// names a stored final the decision found. The view's stored final and the intent to take
    /// are kept for `Action::WriteRecord` and `Action::TakeFinal`.
    async fn decide(&mut self, revision: Option<i64>) -> Result<(Decision, bool), SeamError> {
        let me = self.member().await?;
        let members = self.ctx.etcd.members().await?;
        let objects = &self.ctx.objects;
        let fenced = objects.fenced().await?;
        let all_fenced = handoff::unfenced(&members, &fenced).is_empty();
        let (finals, record, intent, claims) = if all_fenced {
            (
                objects.finals().await?,
                objects.record().await?,
                objects.intent().await?,
                objects.claims().await?,
            )
        } else {
            (Vec::new(), None, None, Vec::new())
        };
        let waited = self.waited(all_fenced, &members, &claims);
        let view = ClusterView {
            members: members.clone(),
            fenced,
            revision,
            finals,
            handoff_record: record.clone(),
            intent: intent.clone(),
            claims,
            me,
            waited,
            takeover_after: self.config.takeover_after,
        };
        let decision = handoff::decide(&view);
        let recorded = match &decision {
            Decision::Done(done) => record
                .as_ref()
                .is_some_and(|r| r.final_snapshot == done.snap_name),
            _ => false,
        };
        match &decision {
            Decision::Take(intent) => self.intent = Some(intent.clone()),
            Decision::Done(done) if !recorded => {
                self.to_record = Some(ToRecord {
                    revision: intent.as_ref().map_or(done.last_revision, |i| i.revision),
                    final_snapshot: done.clone(),
                    members: Some(members),
                })
            }
            _ => {}
        }
        Ok((decision, recorded))
    }

    /// `Action::ReadRevision`: every member fenced and nothing fixed yet, so nothing can write
    /// any more but an expiring lease; the intent freezes what is read here.
    pub(super) async fn read_revision(&mut self) -> Option<i64> {
        let span = self.hand_off_span();
        let result = tracing::Instrument::instrument(self.ctx.etcd.revision(), span.clone()).await;
        let _in = span.enter();
        match result {
            Ok(revision) => Some(revision),
            Err(e) => {
                self.check_failed(&e);
                None
            }
        }
    }

    /// `Action::CreateClaim`: this member's claim of `epoch`, unless one is there.
    pub(super) async fn create_claim(&mut self, epoch: u32) -> bool {
        let span = self.hand_off_span();
        let result = tracing::Instrument::instrument(
            async {
                let me = self.member().await?;
                let claim = Claim {
                    epoch,
                    member_id: format!("{me:x}"),
                    claimed_at: Utc::now(),
                };
                Ok::<_, SeamError>(self.ctx.objects.create_claim(&claim).await?)
            },
            span.clone(),
        )
        .await;
        let _in = span.enter();
        match result {
            Ok(created) if epoch > 0 => {
                tracing::warn!(
                    epoch,
                    ?created,
                    "the member taking the final has not stored it within owner.takeover_after; claiming the take-over"
                );
                true
            }
            Ok(created) => {
                tracing::info!(
                    ?created,
                    "claiming the final snapshot (this member takes it)"
                );
                true
            }
            Err(e) => {
                self.check_failed(&e);
                false
            }
        }
    }

    /// `Action::CreateIntent`: the final's identity at `revision`, unless an intent is there.
    pub(super) async fn create_intent(&mut self, revision: i64) -> bool {
        let span = self.hand_off_span();
        let result = tracing::Instrument::instrument(
            async {
                let me = self.member().await?;
                let intent = FinalIntent {
                    final_snapshot: self
                        .ctx
                        .objects
                        .final_name(revision, self.ctx.codec)
                        .snap_name,
                    revision,
                    member_id: format!("{me:x}"),
                    owner_id: self.config.owner_id.clone(),
                    fixed_at: Utc::now(),
                };
                Ok::<_, SeamError>(self.ctx.objects.create_intent(&intent).await?)
            },
            span.clone(),
        )
        .await;
        let _in = span.enter();
        match result {
            Ok(created) => {
                tracing::info!(
                    revision,
                    ?created,
                    "the final snapshot's identity is fixed before its upload"
                );
                true
            }
            Err(e) => {
                self.check_failed(&e);
                false
            }
        }
    }

    /// How long this member has seen the current taker without a stored final; restarts when the
    /// taker changes (a claim) and is zero until every member is fenced.
    fn waited(&mut self, all_fenced: bool, members: &[Member], claims: &[Claim]) -> Duration {
        if !all_fenced {
            self.taker_seen = None;
            return Duration::ZERO;
        }
        let current = (
            handoff::current_taker(members, claims).map(|(id, _)| id),
            claims.iter().map(|c| c.epoch).max(),
        );
        match self.taker_seen {
            Some((seen, since)) if seen == current => since.elapsed(),
            _ => {
                self.taker_seen = Some((current, Instant::now()));
                Duration::ZERO
            }
        }
    }

    /// `Action::WriteRecord`: the hand-off record naming the final the last take stored or the
    /// last check found unrecorded; the hand-off is done once it is written.
    pub(super) async fn write_record(&mut self) -> bool {
        let span = self.hand_off_span();
        let result = tracing::Instrument::instrument(
            async {
                let Some(to) = self.to_record.clone() else {
                    return Err(SeamError::HandOff(HandOffError::Unsettled));
                };
                let members = match to.members {
                    Some(members) => members,
                    None => self.ctx.etcd.members().await.unwrap_or_default(),
                };
                let record = HandOffRecord {
                    final_snapshot: to.final_snapshot.snap_name.clone(),
                    revision: to.revision,
                    members: members
                        .iter()
                        .filter(|m| m.started)
                        .map(Member::label)
                        .collect(),
                    owner_id: self.config.owner_id.clone(),
                    recorded_at: Utc::now(),
                };
                self.ctx.objects.write_record(&record).await?;
                Ok(to.final_snapshot)
            },
            span.clone(),
        )
        .await;
        let _in = span.enter();
        match result {
            Ok(snap) => {
                tracing::info!(snapshot = %snap.snap_name, revision = snap.last_revision, "the hand-off's final snapshot is recorded");
                self.succeed();
                self.status.send_modify(|s| {
                    s.final_snapshot = Some(snap.snap_name.clone());
                    s.waiting_for.clear();
                });
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "the hand-off record could not be written; checking the store again");
                self.fail(&format!("hand-off record: {e}"));
                false
            }
        }
    }

    /// `Action::TakeFinal`: uploads the final the intent names; the record follows as its own
    /// action.
    pub(super) async fn take_final(&mut self, min_revision: i64, attempt: u32) -> bool {
        let span = tracing::info_span!("final_snapshot", owner_id = %self.config.owner_id, min_revision, attempt, snapshot = tracing::field::Empty);
        let result = tracing::Instrument::instrument(
            async {
                let Some(intent) = self.intent.clone() else {
                    return Err(SeamError::HandOff(HandOffError::Unsettled));
                };
                tracing::Span::current().record("snapshot", intent.final_snapshot.as_str());
                let mut name = self.ctx.objects.final_of(&intent)?;
                // Planted (`crate::plant`): a name of its own per attempt, and the first
                // attempt's answer (attempts count from 1) lost after the store kept it, so a
                // second attempt follows.
                let planted = crate::plant::active("fresh-final-name");
                if planted {
                    name.created_on += chrono::Duration::seconds(i64::from(attempt) + 1);
                    name.snap_name = name.format_name();
                }
                let snap = self.ctx.finals.take_final(name, intent.revision).await?;
                if planted && attempt <= 1 {
                    return Err(SeamError::HandOff(HandOffError::Unsettled));
                }
                Ok::<_, SeamError>((snap, intent.revision))
            },
            span.clone(),
        )
        .await;
        let _in = span.enter();
        match result {
            Ok((snap, revision)) => {
                tracing::info!(snapshot = %snap.snap_name, revision = snap.last_revision, "final snapshot stored");
                self.to_record = Some(ToRecord {
                    final_snapshot: snap,
                    revision,
                    members: None,
                });
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "final snapshot failed; checking the store again before another");
                self.fail(&format!("final snapshot: {e}"));
                false
            }
        }
    }
}
