//! The HTTP API: readiness, snapshots, metrics, status.
