//! Restore an etcd data directory from a full snapshot and its deltas.
