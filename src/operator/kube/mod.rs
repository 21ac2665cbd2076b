//! The operator on Kubernetes: the [`Machines`](super::execute::Machines) seam over
//! `machine.openshift.io` Machines, and the objects the operator keeps in step with etcd.
//!
//! - [`machine`]: the typed `Machine` (only the fields read).
//! - [`machines`]: [`KubeMachines`], the seam's Kubernetes backend.

pub mod machine;
pub mod machines;

pub use machines::{KubeMachines, KubeMachinesConfig};
