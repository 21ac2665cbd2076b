//! Prometheus metrics of the operator, under the `etcd_warden_` prefix.
//!
//! Per-member gauges follow seed 002 (`is_leader`, `is_learner`, `has_leader`); their label is the
//! member name, bounded by the cluster size, and the families are rebuilt on every observation so
//! removed members disappear.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Label of per-member gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MemberLabels {
    /// Member name (hex ID for a member that has not started).
    pub member: String,
}

/// Labels of the action counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabels {
    /// Action kind, e.g. `promote`.
    pub action: String,
    /// `ok` or `error`.
    pub result: String,
}

/// Label of the condition gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConditionLabels {
    /// Condition kind, e.g. `progressing`.
    pub condition: String,
}

/// One member's facts for the gauges.
#[derive(Clone, Debug)]
pub struct MemberGauge {
    /// Member name.
    pub member: String,
    /// This member is the raft leader.
    pub is_leader: bool,
    /// This member is a learner.
    pub is_learner: bool,
    /// This member knows a leader.
    pub has_leader: bool,
}

/// The operator's metrics; cheap to clone (shared handles).
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    is_leader: Family<MemberLabels, Gauge>,
    is_learner: Family<MemberLabels, Gauge>,
    has_leader: Family<MemberLabels, Gauge>,
    voters: Gauge,
    learners: Gauge,
    actions: Family<ActionLabels, Counter>,
    last_action: Family<ActionLabels, Gauge>,
    last_action_time: Gauge<f64, AtomicU64>,
    condition: Family<ConditionLabels, Gauge>,
    set_reconcile_failures: Counter,
}

impl Metrics {
    /// Registers every metric under `etcd_warden_`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("etcd_warden");
        r.register(
            "member_is_leader",
            "1 when the member is the raft leader",
            self.is_leader.clone(),
        );
        r.register(
            "member_is_learner",
            "1 when the member is a raft learner",
            self.is_learner.clone(),
        );
        r.register(
            "member_has_leader",
            "1 when the member knows a leader",
            self.has_leader.clone(),
        );
        r.register("voters", "Voting members observed", self.voters.clone());
        r.register(
            "learners",
            "Learner members observed",
            self.learners.clone(),
        );
        r.register(
            "operator_actions",
            "Actions applied by the operator",
            self.actions.clone(),
        );
        r.register(
            "last_action",
            "1 for the kind and result of the last action applied",
            self.last_action.clone(),
        );
        r.register(
            "last_action_timestamp_seconds",
            "Unix time of the last action applied",
            self.last_action_time.clone(),
        );
        r.register(
            "operator_condition",
            "1 for the operator's current condition",
            self.condition.clone(),
        );
        r.register(
            "control_plane_set_reconcile_failures",
            "ControlPlaneSet reconciles that failed (each retried with backoff)",
            self.set_reconcile_failures.clone(),
        );
    }

    /// A ControlPlaneSet reconcile failed.
    pub fn set_reconcile_failed(&self) {
        self.set_reconcile_failures.inc();
    }

    /// Replaces the per-member gauges with the latest observation.
    pub fn observe_members(&self, members: &[MemberGauge]) {
        self.is_leader.clear();
        self.is_learner.clear();
        self.has_leader.clear();
        let mut voters = 0;
        let mut learners = 0;
        for m in members {
            let l = MemberLabels {
                member: m.member.clone(),
            };
            self.is_leader.get_or_create(&l).set(m.is_leader.into());
            self.is_learner.get_or_create(&l).set(m.is_learner.into());
            self.has_leader.get_or_create(&l).set(m.has_leader.into());
            if m.is_learner {
                learners += 1;
            } else {
                voters += 1;
            }
        }
        self.voters.set(voters);
        self.learners.set(learners);
    }

    /// Records one applied action.
    pub fn action(&self, kind: &str, ok: bool) {
        let l = ActionLabels {
            action: kind.to_owned(),
            result: if ok { "ok" } else { "error" }.to_owned(),
        };
        self.actions.get_or_create(&l).inc();
        self.last_action.clear();
        self.last_action.get_or_create(&l).set(1);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or_default();
        self.last_action_time.set(now);
    }

    /// Records the current condition.
    pub fn condition(&self, kind: &str) {
        self.condition.clear();
        self.condition
            .get_or_create(&ConditionLabels {
                condition: kind.to_owned(),
            })
            .set(1);
    }
}
