//! The operator: two halves of one shape, each its pure plan, its executor or controller with
//! the seam its backends implement, and its resource with a pure status.
//!
//! - [`quorum`]: quorum-safe member replacement: `plan` (pure), `execute` (the executor and the
//!   `Machines` seam), `resource` (`EtcdQuorum` and its status).
//! - [`control_plane_set`]: control-plane Machines kept at a template: `plan` (pure),
//!   `controller` (the controller and the `SetMachines` seam), `resource` (`ControlPlaneSet`,
//!   its validation and status), `generate`.
//! - [`local`]: the local backend of both seams: machines that are etcd processes on loopback
//!   (demo and tests).
//! - [`kube`]: the Kubernetes side of both, side by side: `machines` and `set_machines` (the
//!   seams' backends), `controller` and `set_controller` (the reconcile loops), and the objects
//!   kept in step with etcd.
//! - [`crd`]: the CustomResourceDefinitions, generated from the resources' Rust types.
//! - [`metrics`]: Prometheus metrics of the operator.

pub mod control_plane_set;
pub mod crd;
pub mod kube;
pub mod local;
pub mod metrics;
pub mod quorum;
