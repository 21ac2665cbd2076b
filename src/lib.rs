//! etcd-warden: backs up and restores etcd, guards its ownership during control-plane migration,
//! and keeps etcd quorum safe while control-plane machines are replaced.
//!
//! Module map (one capability per module):
//! - [`backoff`]: the one exponential retry delay.
//! - [`config`]: layered configuration (defaults → file → environment → flags), validated once.
//! - [`telemetry`]: `tracing` setup, human or JSON output.
//! - [`store`]: object stores from URLs, the etcd-backup-restore bucket layout, retention.
//! - [`snapshot`]: full and delta snapshots, their codecs, and the one snapshot actor.
//! - [`etcd`]: the etcd seam: clients (TLS, auth, rotation), and running etcd members.
//! - [`health`]: etcd's health, judged in one place (readiness and the watchdog).
//! - [`owner`]: owner DNS lookups, the pure ownership protocol, the hand-off across members, and
//!   the watchdog.
//! - [`kill`]: finding and killing etcd in a shared PID namespace (the `kill.*` keys).
//! - [`hardening`]: what every binary does first (non-dumpable: secrets out of `/proc`'s reach).
//! - [`kube_client`]: a Kubernetes client from a kubeconfig or the pod's service account.
//! - [`kubernetes`]: the sidecar's Kubernetes face (`[kubernetes]`): `EtcdSnapshot` objects and
//!   Events, never on the safety path.
//! - [`server`]: the HTTP API.
//! - [`sidecar`]: `etcd-warden serve`: the tasks the sidecar starts and supervises.
//! - [`copy`], [`restore`]: the copy job and data-dir restore.
//! - [`compact`]: folding a store's chain into one full snapshot (`etcd-warden compact`).
//! - [`druid`]: what etcd-druid expects of its backup sidecar (`[druid]`: Leases, etcd-wrapper's
//!   endpoints, triggers forwarded to the leader's sidecar).
//! - [`etcdbrctl`]: the binary run as `etcdbrctl`: etcd-backup-restore's flags mapped onto ours.
//! - [`scratch`]: private scratch directories and files (0700/0600, created fresh, never followed).
//! - [`operator`]: quorum-safe member replacement (the second binary).
//! - [`plant`]: planted defects for the robustness harness (debug builds only; `WARDEN_PLANT`).
//! - `fuzzing` (hidden): the fuzz targets' bodies, run on the committed corpora by `cargo test`.
//! - `boundaries` (tests only): the crate's layering, checked from its source.
#![forbid(unsafe_code)]

pub mod backoff;
#[cfg(test)]
mod boundaries;
pub mod compact;
pub mod config;
pub mod copy;
pub mod druid;
pub mod etcd;
pub mod etcdbrctl;
#[doc(hidden)]
pub mod fuzzing;
pub mod hardening;
pub mod health;
pub mod kill;
pub mod kube_client;
pub mod kubernetes;
pub mod operator;
pub mod owner;
pub mod plant;
pub mod restore;
pub mod scratch;
pub mod server;
pub mod sidecar;
pub mod snapshot;
pub mod store;
pub mod telemetry;
