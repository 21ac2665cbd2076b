//! The operator on Kubernetes: both halves' seams over `machine.openshift.io` Machines, side by
//! side with their reconcile loops, and the objects the operator keeps in step with etcd.
//!
//! - [`machines`]: [`KubeMachines`], the quorum seam's
//!   ([`Machines`](super::quorum::execute::Machines)) Kubernetes backend.
//! - [`controller`]: the quorum controller assembled: leader-gated reconciles woken by watches.
//! - [`set_machines`]: [`KubeSetMachines`](set_machines::KubeSetMachines), the ControlPlaneSet
//!   seam's ([`SetMachines`](super::control_plane_set::controller::SetMachines)) backend.
//! - [`set_controller`]: the ControlPlaneSet's reconcile loop, spawned by [`controller`].
//! - [`config`]: `kube`'s layered configuration (file → environment → flags).
//! - [`machine_resource`]: the typed `Machine` (only the fields read).
//! - [`health`]: `/healthz` (every internal task alive), `/readyz`, `/metrics`.
//! - [`endpoints`]: the `etcd-endpoints` ConfigMap built from etcd's member list (pure).
//! - [`quorum_guard`]: the quorum-guard PodDisruptionBudget (pure).
//! - [`events`]: a Kubernetes Event for every action the executor records.
//! - [`lease`]: leader election through a Lease, so two replicas never both act.
//! - [`sync`]: create-or-patch with optimistic concurrency, for the ConfigMap and the PDB.

pub mod config;
pub mod controller;
pub mod endpoints;
pub mod events;
pub mod health;
pub mod lease;
pub mod machine_resource;
pub mod machines;
pub mod quorum_guard;
pub mod set_controller;
pub mod set_machines;
pub mod sync;

pub use machines::{KubeMachines, KubeMachinesConfig};
