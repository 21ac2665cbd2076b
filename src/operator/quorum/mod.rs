//! The quorum half of the operator: etcd's members replaced one at a time without losing quorum.
//!
//! - [`plan`]: the pure planner, from observed members and machines to the next actions.
//! - [`execute`]: the executor, and [`execute::Machines`], the seam its backends implement.
//! - [`resource`]: the `EtcdQuorum` resource and its status, derived purely.
//! - [`request`]: a quorum restore an administrator asks for, and its refusals.
//!
//! Its backends are `operator::local` (etcd processes on loopback) and `operator::kube`
//! (Machines on Kubernetes, where `kube::controller` runs the reconcile loop).

pub mod execute;
pub mod plan;
pub mod request;
pub mod resource;
