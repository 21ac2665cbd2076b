//! The etcd seam, in two parts:
//!
//! - [`client`]: clients built from configuration (endpoints, TLS, auth) for the sidecar and the
//!   operator; files are re-read on rotation, and an auth token etcd no longer knows is renewed.
//! - [`process`]: finding, starting, waiting for and stopping etcd members: restore's temporary
//!   etcd, the operator's local machines, and the tests' and benchmarks' members.
//! - [`membership`]: what a member looks like, quorum, and the initial cluster of a joining
//!   member: facts the restore's rejoin and the operator share.
//!
//! `process` is a leaf: it owns its errors and parameters and imports nothing from `restore` or
//! `operator`, which map its errors into theirs.

pub mod client;
pub mod membership;
pub mod process;

pub use client::{EtcdError, RotatingClient, connect, connect_options};
