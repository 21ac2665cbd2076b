//! The operator on Kubernetes: the [`Machines`](super::quorum::execute::Machines) seam over
//! `machine.openshift.io` Machines, and the objects the operator keeps in step with etcd.
//!
//! - [`config`]: `kube`'s layered configuration (file → environment → flags).
//! - [`controller`]: the controller assembled: leader-gated reconciles woken by watches.
//! - [`machine_resource`]: the typed `Machine` (only the fields read).
//! - [`machines`]: [`KubeMachines`], the seam's Kubernetes backend.
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
pub mod sync;

pub use machines::{KubeMachines, KubeMachinesConfig};
