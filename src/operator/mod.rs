//! The operator: a pure planner for quorum-safe member replacement, its executor, and backends.
//!
//! - [`quorum`]: the quorum half: its pure planner (`plan`), executor and `Machines` seam
//!   (`execute`), and the `EtcdQuorum` resource with its pure status (`resource`).
//! - [`control_plane_set`]: the ControlPlaneSet planner (pure): Machines kept at the template.
//! - [`local`]: a backend whose machines are etcd processes on loopback (demo and tests).
//! - [`kube`]: the backend on Kubernetes (Machines and their deletion hooks).
//! - [`metrics`]: Prometheus metrics of the operator.

pub mod control_plane_set;
pub mod crd;
pub mod kube;
pub mod local;
pub mod metrics;
pub mod quorum;
