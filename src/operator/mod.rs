//! The operator: a pure planner for quorum-safe member replacement, its executor, and backends.
//!
//! - [`plan`]: pure decisions from observed members and machines.
//! - [`execute`]: observes etcd and a [`execute::Machines`] backend, applies planned actions.
//! - [`control_plane_set`]: the ControlPlaneSet planner (pure): Machines kept at the template.
//! - [`local`]: a backend whose machines are etcd processes on loopback (demo and tests).
//! - [`kube`]: the backend on Kubernetes (Machines and their deletion hooks).
//! - [`metrics`]: Prometheus metrics of the operator.

pub mod control_plane_set;
pub mod crd;
pub mod execute;
pub mod kube;
pub mod local;
pub mod metrics;
pub mod plan;
