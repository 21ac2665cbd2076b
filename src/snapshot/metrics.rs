//! Snapshot metrics, named as etcd-backup-restore names them (`etcdbr_…`) so existing
//! dashboards and alerts keep working; what the reference has no metric for is
//! `etcd_warden_snapshot_…`. The member's place in the cluster (`etcdbr_cluster_size`,
//! `etcdbr_is_learner`) is here too: the actor's leadership poll is what reads it.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::store::{Kind, Snapshot};

/// `kind` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// `Full` or `Incr`.
    pub kind: String,
}

/// `error` label: a bounded class of the failure (the reference puts the whole message there,
/// one series per distinct message; a class keeps the series few and still says where to look).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabel {
    /// One of [`FAILURE_CLASSES`].
    pub error: String,
}

/// Every value of the `error` label of `etcdbr_snapshotter_failure`, created at zero.
pub const FAILURE_CLASSES: [&str; 7] = [
    "etcd", "store", "codec", "behind", "delta", "watch", "timeout",
];

/// `kind` and `succeeded` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// `Full` or `Incr`.
    pub kind: String,
    /// `true` or `false`.
    pub succeeded: String,
}

/// `succeeded` label alone (`etcdbr_defragmentation_duration_seconds`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SucceededLabel {
    /// `true` or `false`.
    pub succeeded: String,
}

/// `result` label of `etcd_warden_defrag_passes_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// One of [`PASS_RESULTS`].
    pub result: String,
}

/// Every value of the `result` label of `etcd_warden_defrag_passes_total`: `done` (a member was
/// defragmented), `idle` (none was over the rule), `stopped` (kill switch, health, learner or
/// leadership: see the skipped members' reasons), `failed` (an error or a timeout), `cancelled`
/// (ownership changed while it ran).
pub const PASS_RESULTS: [&str; 5] = ["done", "idle", "stopped", "failed", "cancelled"];

/// `reason` label of `etcd_warden_defrag_members_skipped_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// A [`StopReason`](super::defrag::StopReason)'s label or `below_threshold`.
    pub reason: String,
}

/// `member` label: a member's ID in hex, as etcdctl prints it (a handful per cluster).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MemberLabel {
    /// The member ID in hex.
    pub member: String,
}

/// A histogram of seconds whose first bucket ends at `FIRST_MS` milliseconds, each next one at
/// twice the last, `BUCKETS` of them.
pub fn doubling_seconds<const FIRST_MS: u32, const BUCKETS: u16>() -> Histogram {
    Histogram::new(exponential_buckets(
        f64::from(FIRST_MS) / 1000.0,
        2.0,
        BUCKETS,
    ))
}

fn outcome(kind: Kind, ok: bool) -> OutcomeLabels {
    OutcomeLabels {
        kind: kind.to_string(),
        succeeded: ok.to_string(),
    }
}

fn kind(kind: Kind) -> KindLabel {
    KindLabel {
        kind: kind.to_string(),
    }
}

/// The snapshot metrics; cheap to clone (shared handles).
#[derive(Clone, Debug)]
pub struct SnapshotMetrics {
    duration: Family<OutcomeLabels, Histogram>,
    latest_revision: Family<KindLabel, Gauge>,
    latest_timestamp: Family<KindLabel, Gauge>,
    gc: Family<OutcomeLabels, Counter>,
    gc_locked: Gauge,
    leader: Gauge,
    delta_buffered: Gauge,
    required: Family<KindLabel, Gauge>,
    failures: Family<ErrorLabel, Gauge>,
    latest_deltas: Gauge,
    latest_deltas_revisions: Gauge,
    latest_size: Family<KindLabel, Gauge>,
    cluster_size: Gauge,
    is_learner: Gauge,
    defrag: Family<SucceededLabel, Histogram>,
    defrag_passes: Family<ResultLabel, Counter>,
    defrag_members: Counter,
    defrag_skipped: Family<ReasonLabel, Counter>,
    defrag_moves: Counter,
    member_free: Family<MemberLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    member_db_size: Family<MemberLabel, Gauge>,
}

impl Default for SnapshotMetrics {
    fn default() -> Self {
        Self {
            // 0.1 s … ~1.9 h: a delta takes milliseconds, a large full snapshot minutes.
            duration: Family::new_with_constructor(doubling_seconds::<100, 16>),
            latest_revision: Family::default(),
            latest_timestamp: Family::default(),
            gc: Family::default(),
            gc_locked: Gauge::default(),
            leader: Gauge::default(),
            delta_buffered: Gauge::default(),
            required: Family::default(),
            failures: Family::default(),
            latest_deltas: Gauge::default(),
            latest_deltas_revisions: Gauge::default(),
            latest_size: Family::default(),
            cluster_size: Gauge::default(),
            is_learner: Gauge::default(),
            // 0.1 s … ~1.9 h, as snapshots: a small database takes a second, a large one minutes.
            defrag: Family::new_with_constructor(doubling_seconds::<100, 16>),
            defrag_passes: Family::default(),
            defrag_members: Counter::default(),
            defrag_skipped: Family::default(),
            defrag_moves: Counter::default(),
            member_free: Family::default(),
            member_db_size: Family::default(),
        }
    }
}

impl SnapshotMetrics {
    /// Registers the metrics (names without a prefix: they carry `etcdbr_` themselves).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "etcdbr_snapshot_duration_seconds",
            "Total latency distribution of saving snapshot to object store",
            self.duration.clone(),
        );
        registry.register(
            "etcdbr_snapshot_latest_revision",
            "Revision number of latest snapshot taken",
            self.latest_revision.clone(),
        );
        registry.register(
            "etcdbr_snapshot_latest_timestamp",
            "Timestamp of latest snapshot taken",
            self.latest_timestamp.clone(),
        );
        registry.register(
            "etcdbr_snapshot_gc",
            "Total number of garbage collected snapshots",
            self.gc.clone(),
        );
        registry.register(
            "etcd_warden_gc_locked_objects",
            "Snapshots the last retention pass would have deleted but the store keeps under \
             retention or a legal hold (S3 Object Lock, GCS retention, Azure immutability)",
            self.gc_locked.clone(),
        );
        registry.register(
            "etcd_warden_snapshot_leader",
            "1 while this sidecar's member leads the raft group, so it is the one taking snapshots",
            self.leader.clone(),
        );
        registry.register(
            "etcd_warden_delta_buffered_bytes",
            "Bytes of watch events held for the next delta snapshot; at snapshot.delta_memory_limit \
             the watch is not read until a delta is stored",
            self.delta_buffered.clone(),
        );
        registry.register(
            "etcdbr_snapshot_required",
            "Indicates whether a snapshot is required to be taken: 1 while a full snapshot is due \
             and not stored, or watch events are buffered and not yet in a delta",
            self.required.clone(),
        );
        // A gauge that only grows: the reference's counter is exposed without `_total`, which
        // OpenMetrics requires of a counter; this keeps the name dashboards query.
        registry.register(
            "etcdbr_snapshotter_failure",
            "Total number of snapshotter errors (full, delta, watch), by class",
            self.failures.clone(),
        );
        registry.register(
            "etcdbr_snapstore_latest_deltas_total",
            "Total number of delta snapshots taken since the latest full snapshot",
            self.latest_deltas.clone(),
        );
        registry.register(
            "etcdbr_snapstore_latest_deltas_revisions_total",
            "Total number of revisions stored in delta snapshots taken since the latest full \
             snapshot (last delta's last revision minus first delta's start revision)",
            self.latest_deltas_revisions.clone(),
        );
        registry.register(
            "etcd_warden_snapshot_latest_size_bytes",
            "Stored (compressed) size of the latest snapshot stored by this sidecar",
            self.latest_size.clone(),
        );
        registry.register(
            "etcdbr_cluster_size",
            "Current Etcd cluster size (members in etcd's member list)",
            self.cluster_size.clone(),
        );
        registry.register(
            "etcdbr_is_learner",
            "Whether or not this member is a learner: 1 if it is, 0 otherwise",
            self.is_learner.clone(),
        );
        registry.register(
            "etcdbr_defragmentation_duration_seconds",
            "Total latency distribution of defragmentation of etcd (one member's defragmentation)",
            self.defrag.clone(),
        );
        for ok in [true, false] {
            drop(self.defrag.get_or_create(&SucceededLabel {
                succeeded: ok.to_string(),
            }));
        }
        registry.register(
            "etcd_warden_defrag_passes",
            "Defragmentation passes (scheduled, triggered by fragmentation, or requested) by result",
            self.defrag_passes.clone(),
        );
        registry.register(
            "etcd_warden_defrag_members_defragmented",
            "Members defragmented by defragmentation passes",
            self.defrag_members.clone(),
        );
        registry.register(
            "etcd_warden_defrag_members_skipped",
            "Members a defragmentation pass left alone, by reason",
            self.defrag_skipped.clone(),
        );
        registry.register(
            "etcd_warden_defrag_leader_moves",
            "Leadership moves a defragmentation pass made so as not to defragment the leader",
            self.defrag_moves.clone(),
        );
        registry.register(
            "etcd_warden_defrag_member_free_fraction",
            "Free fraction of each member's database file, (dbSize - dbSizeInUse) / dbSize, at the last defragmentation step or check",
            self.member_free.clone(),
        );
        registry.register(
            "etcd_warden_defrag_member_db_size_bytes",
            "Size of each member's database file at the last defragmentation step or check",
            self.member_db_size.clone(),
        );
        for result in PASS_RESULTS {
            drop(self.defrag_passes.get_or_create(&ResultLabel {
                result: result.into(),
            }));
        }
        let reasons = super::defrag::StopReason::ALL.map(|r| r.label());
        for reason in reasons.into_iter().chain(["below_threshold"]) {
            drop(self.defrag_skipped.get_or_create(&ReasonLabel {
                reason: reason.into(),
            }));
        }
        for class in FAILURE_CLASSES {
            drop(self.failures.get_or_create(&ErrorLabel {
                error: class.into(),
            }));
        }
        for k in [Kind::Full, Kind::Incr] {
            for ok in [true, false] {
                // Created at zero so every series is there from the start (as the reference).
                drop(self.duration.get_or_create(&outcome(k, ok)));
                drop(self.gc.get_or_create(&outcome(k, ok)));
            }
            drop(self.latest_revision.get_or_create(&kind(k)));
            drop(self.latest_timestamp.get_or_create(&kind(k)));
            drop(self.required.get_or_create(&kind(k)));
            drop(self.latest_size.get_or_create(&kind(k)));
        }
    }

    /// Records a stored snapshot of `bytes` in the store. A full snapshot starts a new chain:
    /// no deltas since it, nothing required.
    pub fn stored(&self, s: &Snapshot, bytes: u64, seconds: f64) {
        self.duration
            .get_or_create(&outcome(s.kind, true))
            .observe(seconds);
        self.latest_revision
            .get_or_create(&kind(s.kind))
            .set(s.last_revision);
        self.latest_timestamp
            .get_or_create(&kind(s.kind))
            .set(s.created_on.timestamp());
        self.latest_size
            .get_or_create(&kind(s.kind))
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        match s.kind {
            Kind::Full => {
                self.latest_deltas.set(0);
                self.latest_deltas_revisions.set(0);
                self.set_required(Kind::Full, false);
            }
            Kind::Incr => {
                // The chain's first delta starts right after its full snapshot, so the span
                // grows by what this delta adds.
                let first = self.latest_deltas.inc() == 0;
                let added = s.last_revision - s.start_revision;
                if first {
                    self.latest_deltas_revisions.set(added);
                } else {
                    self.latest_deltas_revisions.inc_by(added + 1);
                }
            }
        }
    }

    /// Sets the delta gauges from the store's latest chain (when the actor starts or becomes
    /// the snapshot leader), as the reference does whenever it reads the chain.
    pub fn chain(&self, chain: &crate::store::Chain) {
        let deltas = &chain.delta_snapshots;
        self.latest_deltas
            .set(i64::try_from(deltas.len()).unwrap_or(i64::MAX));
        let span = match (deltas.first(), deltas.last()) {
            (Some(first), Some(last)) => last.last_revision - first.start_revision,
            _ => 0,
        };
        self.latest_deltas_revisions.set(span);
    }

    /// Whether a snapshot of `k` is due and not stored yet.
    pub fn set_required(&self, k: Kind, required: bool) {
        self.required
            .get_or_create(&kind(k))
            .set(i64::from(required));
    }

    /// Counts a failed snapshotter operation by class (one of [`FAILURE_CLASSES`]).
    pub fn failure(&self, class: &'static str) {
        self.failures
            .get_or_create(&ErrorLabel {
                error: class.into(),
            })
            .inc();
    }

    /// Records the member's place in the cluster; `cluster_size` is `None` when the member list
    /// could not be read (the last value stays).
    pub fn membership(&self, is_learner: bool, cluster_size: Option<u64>) {
        self.is_learner.set(i64::from(is_learner));
        if let Some(n) = cluster_size {
            self.cluster_size.set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Records one member's defragmentation (or its failure) that took `seconds`.
    pub fn defragmented(&self, ok: bool, seconds: f64) {
        self.defrag
            .get_or_create(&SucceededLabel {
                succeeded: ok.to_string(),
            })
            .observe(seconds);
    }

    /// Counts a defragmentation pass that ended with `result` (one of [`PASS_RESULTS`]).
    pub fn defrag_pass(&self, result: &str) {
        self.defrag_passes
            .get_or_create(&ResultLabel {
                result: result.into(),
            })
            .inc();
    }

    /// Counts a member a pass defragmented.
    pub fn defrag_member(&self) {
        self.defrag_members.inc();
    }

    /// Counts `n` members a pass left alone for `reason`.
    pub fn defrag_skipped(&self, reason: &str, n: usize) {
        self.defrag_skipped
            .get_or_create(&ReasonLabel {
                reason: reason.into(),
            })
            .inc_by(n as u64);
    }

    /// Counts a leadership move a pass made.
    pub fn defrag_leader_moved(&self) {
        self.defrag_moves.inc();
    }

    /// Records each member's database size and free fraction; members no longer listed are
    /// dropped, so the series stay as many as the members.
    pub fn defrag_members_seen(&self, members: &[super::defrag::MemberState]) {
        let labels: Vec<MemberLabel> = members
            .iter()
            .map(|m| MemberLabel {
                member: format!("{:x}", m.id),
            })
            .collect();
        self.member_db_size.clear();
        self.member_free.clear();
        for (m, label) in members.iter().zip(labels) {
            // A member that did not answer reports no sizes: leave it out rather than show 0.
            if !m.healthy {
                continue;
            }
            self.member_free
                .get_or_create(&label)
                .set(m.free_fraction());
            self.member_db_size.get_or_create(&label).set(m.db_size);
        }
    }

    /// Records whether this sidecar is the snapshot leader.
    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }

    /// Bytes of watch events buffered for the next delta snapshot.
    pub fn set_delta_buffered(&self, bytes: u64) {
        self.delta_buffered
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// Records a failed snapshot attempt.
    pub fn failed(&self, k: Kind, seconds: f64) {
        self.duration
            .get_or_create(&outcome(k, false))
            .observe(seconds);
    }

    /// Records a retention run.
    pub fn gc(&self, report: &crate::store::gc::GcReport) {
        for s in &report.deleted {
            self.gc.get_or_create(&outcome(s.kind, true)).inc();
        }
        for s in &report.failed {
            self.gc.get_or_create(&outcome(s.kind, false)).inc();
        }
        self.gc_locked
            .set(i64::try_from(report.locked.len()).unwrap_or(i64::MAX));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Codec;

    #[test]
    fn exposes_reference_names() {
        let m = SnapshotMetrics::default();
        let mut reg = Registry::default();
        m.register(&mut reg);
        let s = Snapshot::new(
            "",
            Kind::Full,
            0,
            42,
            chrono::DateTime::from_timestamp(1_700_000_000, 0).unwrap(),
            Codec::Gzip,
            false,
        );
        m.stored(&s, 1234, 1.5);
        m.gc(&crate::store::gc::GcReport {
            deleted: vec![s.clone()],
            failed: vec![],
            locked: vec![s.clone(), s.clone()],
        });
        let out = render(&reg);
        assert!(
            out.contains(r#"etcdbr_snapshot_latest_revision{kind="Full"} 42"#),
            "{out}"
        );
        assert!(out.contains(r#"etcdbr_snapshot_latest_timestamp{kind="Full"} 1700000000"#));
        assert!(out.contains(r#"etcdbr_snapshot_gc_total{kind="Full",succeeded="true"} 1"#));
        assert!(out.contains("etcd_warden_gc_locked_objects 2"), "{out}");
        assert!(
            out.contains(
                r#"etcdbr_snapshot_duration_seconds_count{kind="Full",succeeded="true"} 1"#
            )
        );
        assert!(out.contains(r#"etcdbr_snapshot_gc_total{kind="Incr",succeeded="false"} 0"#));
        assert!(out.contains(r#"etcd_warden_snapshot_latest_size_bytes{kind="Full"} 1234"#));
        // Every series of the reference's newer metrics is there from the start.
        for line in [
            r#"etcdbr_snapshot_required{kind="Incr"} 0"#,
            r#"etcdbr_snapshotter_failure{error="timeout"} 0"#,
            "etcdbr_snapstore_latest_deltas_total 0",
            "etcdbr_snapstore_latest_deltas_revisions_total 0",
            "etcdbr_cluster_size 0",
            "etcdbr_is_learner 0",
        ] {
            assert!(out.contains(line), "{line} missing:\n{out}");
        }
    }

    fn render(reg: &Registry) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, reg).unwrap();
        out
    }

    fn snap(kind: Kind, start: i64, last: i64) -> Snapshot {
        Snapshot::new(
            "",
            kind,
            start,
            last,
            chrono::DateTime::from_timestamp(1_700_000_000 + last, 0).unwrap(),
            Codec::Gzip,
            false,
        )
    }

    #[test]
    fn delta_gauges_count_the_chain_since_the_latest_full_snapshot() {
        let m = SnapshotMetrics::default();
        let mut reg = Registry::default();
        m.register(&mut reg);
        m.stored(&snap(Kind::Full, 0, 10), 100, 1.0);
        m.stored(&snap(Kind::Incr, 11, 15), 10, 0.1);
        m.stored(&snap(Kind::Incr, 16, 16), 10, 0.1);
        m.stored(&snap(Kind::Incr, 17, 30), 10, 0.1);
        let out = render(&reg);
        assert!(
            out.contains("etcdbr_snapstore_latest_deltas_total 3\n"),
            "{out}"
        );
        // As the reference computes it from the store: last delta's last minus first's start.
        assert!(
            out.contains("etcdbr_snapstore_latest_deltas_revisions_total 19\n"),
            "{out}"
        );
        // The same from the store's chain (what a restarted sidecar reports).
        let m2 = SnapshotMetrics::default();
        let mut reg2 = Registry::default();
        m2.register(&mut reg2);
        m2.chain(&crate::store::Chain {
            full_snapshot: Some(snap(Kind::Full, 0, 10)),
            delta_snapshots: vec![
                snap(Kind::Incr, 11, 15),
                snap(Kind::Incr, 16, 16),
                snap(Kind::Incr, 17, 30),
            ],
        });
        let out2 = render(&reg2);
        assert!(
            out2.contains("etcdbr_snapstore_latest_deltas_total 3\n"),
            "{out2}"
        );
        assert!(out2.contains("etcdbr_snapstore_latest_deltas_revisions_total 19\n"));
        // A new full snapshot starts a new chain.
        m.set_required(Kind::Full, true);
        assert!(render(&reg).contains(r#"etcdbr_snapshot_required{kind="Full"} 1"#));
        m.stored(&snap(Kind::Full, 0, 31), 100, 1.0);
        let out = render(&reg);
        assert!(
            out.contains("etcdbr_snapstore_latest_deltas_total 0\n"),
            "{out}"
        );
        assert!(out.contains("etcdbr_snapstore_latest_deltas_revisions_total 0\n"));
        assert!(out.contains(r#"etcdbr_snapshot_required{kind="Full"} 0"#));
    }

    #[test]
    fn failures_by_class_and_membership() {
        let m = SnapshotMetrics::default();
        let mut reg = Registry::default();
        m.register(&mut reg);
        m.failure("timeout");
        m.failure("timeout");
        m.failure("store");
        m.membership(true, Some(3));
        m.membership(true, None);
        let out = render(&reg);
        assert!(
            out.contains(r#"etcdbr_snapshotter_failure{error="timeout"} 2"#),
            "{out}"
        );
        assert!(out.contains(r#"etcdbr_snapshotter_failure{error="store"} 1"#));
        assert!(out.contains(r#"etcdbr_snapshotter_failure{error="etcd"} 0"#));
        assert!(out.contains("etcdbr_cluster_size 3\n"), "{out}");
        assert!(out.contains("etcdbr_is_learner 1\n"));
    }
}
