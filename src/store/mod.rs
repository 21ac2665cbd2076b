//! Object stores from URLs, the etcd-backup-restore bucket layout, and retention.

pub mod location;

pub use location::StoreLocation;
