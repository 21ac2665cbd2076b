//! The ControlPlaneSet half of the operator (seeds 003 and 004): 3 or 5 control-plane Machines
//! kept at a template's spec, spread over failure domains, replaced one at a time.
//!
//! - [`plan`]: the pure planner, from the set's spec, its Machines and their etcd members to the
//!   next Machine actions.
//! - [`controller`]: the controller, and [`controller::SetMachines`], the seam its backends
//!   implement.
//! - [`resource`]: the `ControlPlaneSet` resource, its validation and its pure status.
//! - [`generate`]: a set drawn from the Machines as they are (pure).
//!
//! Its backends are `operator::local` (etcd processes on loopback) and `operator::kube`
//! (Machines on Kubernetes, where `kube::set_controller` runs the reconcile loop).

pub mod controller;
pub mod generate;
pub mod plan;
pub mod resource;
