//! Restore an etcd data directory from a full snapshot and its deltas.
//!
//! The full snapshot is restored with the etcd release's own tool into `<data-dir>.part`; a
//! temporary etcd on loopback replays the deltas; the result is synced and renamed into place.
//! Any failure leaves an existing data directory untouched.

pub mod replay;
pub mod tools;

use std::path::Path;

/// What went wrong in a restore; each says which step.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("{0}")]
    Tools(String),
    #[error("{0}")]
    Deltas(String),
    #[error("etcd: {0}")]
    Etcd(String),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Store(String),
}

impl RestoreError {
    /// An I/O error on `path`.
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        RestoreError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}
