//! Full and delta snapshots, their payload codecs, and the one snapshot actor.
