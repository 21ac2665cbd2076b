//! Full and delta snapshots, their payload codecs, and the one snapshot actor.
//!
//! The [`actor`] serialises every snapshot; its production [`engine`] calls [`full::take_full`]
//! and drives a [`delta::DeltaWriter`] from a watch; both write through
//! [`crate::store::SnapshotStore`].

pub mod actor;
pub mod defrag;
pub mod delta;
pub mod engine;
pub mod full;
pub mod gate;
pub mod metrics;
pub mod verify;
pub mod watcher;

pub use full::take_full;
