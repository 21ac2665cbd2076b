//! Store URLs: `file:///dir`, `memory://`, `s3://bucket/prefix`, `gs://bucket/prefix`,
//! `az://container/prefix`.
//!
//! A store's location is part of its configuration ([`crate::config::StoreConfig`]), so the type
//! and its parser live in `config`, which imports nothing from `store`; this path stays for the
//! code that names it here.

pub use crate::config::{LocationError, StoreLocation};
