//! Full and delta snapshots, their payload codecs, and the one snapshot actor.
//!
//! The actor (the lead's) calls [`full::take_full`] and drives a [`delta::DeltaWriter`] from a
//! watch; both write through [`crate::store::SnapshotStore`].

pub mod delta;
pub mod full;
pub mod metrics;
pub mod watcher;

pub use delta::{DeltaWriter, Event, EventType, KeyValue, TimedEvent};
pub use full::take_full;
