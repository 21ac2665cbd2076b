//! Snapshot metrics, named as etcd-backup-restore names them (`etcdbr_snapshot_…`) so existing
//! dashboards and alerts keep working.

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

/// `kind` and `succeeded` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// `Full` or `Incr`.
    pub kind: String,
    /// `true` or `false`.
    pub succeeded: String,
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
    leader: Gauge,
}

impl Default for SnapshotMetrics {
    fn default() -> Self {
        Self {
            // 0.1 s … ~1.9 h: a delta takes milliseconds, a large full snapshot minutes.
            duration: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.1, 2.0, 16))
            }),
            latest_revision: Family::default(),
            latest_timestamp: Family::default(),
            gc: Family::default(),
            leader: Gauge::default(),
        }
    }
}

impl SnapshotMetrics {
    /// Registers the metrics (names without a prefix: they carry `etcdbr_` themselves).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "etcdbr_snapshot_duration_seconds",
            "Total latency distribution of saving snapshot to object store.",
            self.duration.clone(),
        );
        registry.register(
            "etcdbr_snapshot_latest_revision",
            "Revision number of latest snapshot taken.",
            self.latest_revision.clone(),
        );
        registry.register(
            "etcdbr_snapshot_latest_timestamp",
            "Timestamp of latest snapshot taken.",
            self.latest_timestamp.clone(),
        );
        registry.register(
            "etcdbr_snapshot_gc",
            "Total number of garbage collected snapshots.",
            self.gc.clone(),
        );
        registry.register(
            "etcd_warden_snapshot_leader",
            "1 while this sidecar's member leads the raft group, so it is the one taking snapshots.",
            self.leader.clone(),
        );
        for k in [Kind::Full, Kind::Incr] {
            for ok in [true, false] {
                // Created at zero so every series is there from the start (as the reference).
                drop(self.duration.get_or_create(&outcome(k, ok)));
                drop(self.gc.get_or_create(&outcome(k, ok)));
            }
            drop(self.latest_revision.get_or_create(&kind(k)));
            drop(self.latest_timestamp.get_or_create(&kind(k)));
        }
    }

    /// Records a stored snapshot.
    pub fn stored(&self, s: &Snapshot, seconds: f64) {
        self.duration
            .get_or_create(&outcome(s.kind, true))
            .observe(seconds);
        self.latest_revision
            .get_or_create(&kind(s.kind))
            .set(s.last_revision);
        self.latest_timestamp
            .get_or_create(&kind(s.kind))
            .set(s.created_on.timestamp());
    }

    /// Records whether this sidecar is the snapshot leader.
    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
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
        m.stored(&s, 1.5);
        m.gc(&crate::store::gc::GcReport {
            deleted: vec![s.clone()],
            failed: vec![],
        });
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &reg).unwrap();
        assert!(
            out.contains(r#"etcdbr_snapshot_latest_revision{kind="Full"} 42"#),
            "{out}"
        );
        assert!(out.contains(r#"etcdbr_snapshot_latest_timestamp{kind="Full"} 1700000000"#));
        assert!(out.contains(r#"etcdbr_snapshot_gc_total{kind="Full",succeeded="true"} 1"#));
        assert!(
            out.contains(
                r#"etcdbr_snapshot_duration_seconds_count{kind="Full",succeeded="true"} 1"#
            )
        );
        assert!(out.contains(r#"etcdbr_snapshot_gc_total{kind="Incr",succeeded="false"} 0"#));
    }
}
