//! Metrics of the ownership watchdog, all prefixed `etcd_warden_owner_` (the reference
//! implementation has no ownership metrics to be compatible with).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::protocol::State;
use super::resolve::CheckResult;
use crate::kill::{KillReport, Outcome};

/// Every state name, so the state gauge always shows all of them (one at 1, the rest at 0).
const STATES: [&str; 4] = ["starting", "active", "suspended", "deactivated"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SignalLabel {
    signal: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KillLabel {
    result: &'static str,
}

/// A gauge computed when scraped: seconds since the last successful check (or since the
/// watchdog started, while no check has succeeded).
#[derive(Debug, Clone)]
struct SecondsSince(Arc<Mutex<Instant>>);

impl SecondsSince {
    fn reset(&self) {
        // A poisoned lock only means a panic elsewhere while holding it; the Instant is still valid.
        let mut at = self.0.lock().unwrap_or_else(|p| p.into_inner());
        *at = Instant::now();
    }

    fn seconds(&self) -> f64 {
        let at = self.0.lock().unwrap_or_else(|p| p.into_inner());
        at.elapsed().as_secs_f64()
    }
}

impl EncodeMetric for SecondsSince {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_gauge(&self.seconds())
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Gauge
    }
}

/// The ownership watchdog's metrics; cheap to clone (all clones share the values).
#[derive(Debug, Clone)]
pub struct OwnerMetrics {
    checks: Family<ResultLabel, Counter>,
    state: Family<StateLabel, Gauge>,
    since_success: SecondsSince,
    consecutive_failures: Gauge,
    signals: Family<SignalLabel, Counter>,
    kill_attempts: Family<KillLabel, Counter>,
    process_visible: Gauge,
    final_snapshot_taken: Gauge,
}

impl Default for OwnerMetrics {
    fn default() -> Self {
        let metrics = OwnerMetrics {
            checks: Family::default(),
            state: Family::default(),
            since_success: SecondsSince(Arc::new(Mutex::new(Instant::now()))),
            consecutive_failures: Gauge::default(),
            signals: Family::default(),
            kill_attempts: Family::default(),
            process_visible: Gauge::default(),
            final_snapshot_taken: Gauge::default(),
        };
        metrics.set_state(&State::Starting);
        metrics
    }
}

impl OwnerMetrics {
    /// Registers every metric under `registry` with the prefix `etcd_warden_owner`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("etcd_warden_owner");
        r.register(
            "checks",
            "Owner record lookups by result",
            self.checks.clone(),
        );
        r.register(
            "state",
            "1 for the current ownership state, 0 for the others",
            self.state.clone(),
        );
        r.register(
            "seconds_since_last_success",
            "Seconds since the owner record was last looked up successfully",
            self.since_success.clone(),
        );
        r.register(
            "consecutive_failures",
            "Failed owner lookups in a row",
            self.consecutive_failures.clone(),
        );
        r.register(
            "kills",
            "Signals sent to etcd, by signal",
            self.signals.clone(),
        );
        r.register(
            "kill_attempts",
            "Kills of etcd by result: verified, not_found, refused (EPERM), still_alive, error",
            self.kill_attempts.clone(),
        );
        r.register(
            "etcd_process_visible",
            "1 when the etcd process is visible and may be signalled",
            self.process_visible.clone(),
        );
        r.register(
            "final_snapshot_taken",
            "1 once this process has a final full snapshot in the store",
            self.final_snapshot_taken.clone(),
        );
    }

    /// Counts one lookup; an answer (owner or not) counts as success.
    pub fn record_check(&self, result: &CheckResult, consecutive_failures: u32) {
        self.checks
            .get_or_create(&ResultLabel {
                result: result.label(),
            })
            .inc();
        if result.verdict().is_some() {
            self.since_success.reset();
        }
        self.consecutive_failures
            .set(i64::from(consecutive_failures));
    }

    /// Shows `state` as the current one.
    pub fn set_state(&self, state: &State) {
        for name in STATES {
            let value = i64::from(name == state.name());
            self.state
                .get_or_create(&StateLabel { state: name })
                .set(value);
        }
    }

    /// Counts the signals a kill sent and its result.
    pub fn record_kill(&self, report: &KillReport) {
        let (terms, kills) = report.signals_sent();
        self.signals
            .get_or_create(&SignalLabel { signal: "SIGTERM" })
            .inc_by(terms as u64);
        self.signals
            .get_or_create(&SignalLabel { signal: "SIGKILL" })
            .inc_by(kills as u64);
        let result = if report.verified() {
            "verified"
        } else if report.not_found() {
            "not_found"
        } else if report
            .processes
            .iter()
            .any(|(_, o)| matches!(o, Outcome::Refused { .. }))
        {
            "refused"
        } else {
            "still_alive"
        };
        self.kill_attempts
            .get_or_create(&KillLabel { result })
            .inc();
    }

    /// Counts a kill that could not even look for etcd.
    pub fn record_kill_error(&self) {
        self.kill_attempts
            .get_or_create(&KillLabel { result: "error" })
            .inc();
    }

    /// Whether the etcd process is visible and may be signalled.
    pub fn set_process_visible(&self, visible: bool) {
        self.process_visible.set(i64::from(visible));
    }

    /// Marks the final snapshot as in the store.
    pub fn set_final_snapshot_taken(&self, taken: bool) {
        self.final_snapshot_taken.set(i64::from(taken));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kill::ProcessId;
    use crate::owner::protocol::FinalStep;
    use crate::owner::resolve::Failure;

    fn text(registry: &Registry) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, registry).expect("encode");
        out
    }

    #[test]
    fn metrics_are_exposed_under_their_names() {
        let metrics = OwnerMetrics::default();
        let mut registry = Registry::default();
        metrics.register(&mut registry);

        metrics.record_check(&CheckResult::Owner, 0);
        metrics.record_check(&CheckResult::Failed(Failure::Timeout), 1);
        metrics.record_check(&CheckResult::Failed(Failure::Timeout), 2);
        metrics.set_state(&State::Deactivated(FinalStep::Killing));
        let p = ProcessId {
            pid: 1,
            start_time: 1,
        };
        metrics.record_kill(&KillReport {
            processes: vec![(p, Outcome::Killed)],
        });
        metrics.record_kill(&KillReport::default());
        metrics.set_process_visible(true);
        metrics.set_final_snapshot_taken(true);

        let out = text(&registry);
        for line in [
            "etcd_warden_owner_checks_total{result=\"owner\"} 1",
            "etcd_warden_owner_checks_total{result=\"timeout\"} 2",
            "etcd_warden_owner_state{state=\"deactivated\"} 1",
            "etcd_warden_owner_state{state=\"active\"} 0",
            "etcd_warden_owner_consecutive_failures 2",
            "etcd_warden_owner_kills_total{signal=\"SIGTERM\"} 1",
            "etcd_warden_owner_kills_total{signal=\"SIGKILL\"} 1",
            "etcd_warden_owner_kill_attempts_total{result=\"verified\"} 1",
            "etcd_warden_owner_kill_attempts_total{result=\"not_found\"} 1",
            "etcd_warden_owner_etcd_process_visible 1",
            "etcd_warden_owner_final_snapshot_taken 1",
        ] {
            assert!(out.contains(line), "missing {line:?} in\n{out}");
        }
        assert!(out.contains("# TYPE etcd_warden_owner_seconds_since_last_success gauge"));
    }

    #[test]
    fn seconds_since_success_grows_and_resets_on_an_answer() {
        let metrics = OwnerMetrics::default();
        std::thread::sleep(std::time::Duration::from_millis(30));
        metrics.record_check(&CheckResult::Failed(Failure::Timeout), 1);
        assert!(
            metrics.since_success.seconds() >= 0.03,
            "a failure is no success"
        );
        metrics.record_check(&CheckResult::NoRecord, 0);
        assert!(
            metrics.since_success.seconds() < 0.03,
            "an answer is a success"
        );
    }
}
