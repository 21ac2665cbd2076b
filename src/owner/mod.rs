//! Ownership: owner DNS lookups, the pure state machine, and the watchdog that acts on it.

pub mod adapters;
pub mod machine;
pub mod metrics;
pub mod resolve;
pub mod watchdog;

pub use machine::{Action, Backoff, Event, FinalOutcome, FinalStep, Machine, State, Verdict};
pub use metrics::OwnerMetrics;
pub use resolve::{CheckResult, Failure, FailureCounter, OwnerLookup, OwnerResolver, ResolveError};
pub use watchdog::{
    EtcdHealth, ReadinessSink, SeamError, Seams, Snapshotter, Watchdog, WatchdogConfig,
    WatchdogStatus,
};
