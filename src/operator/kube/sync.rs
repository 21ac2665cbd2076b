//! Keeping one object in step: create it when missing, else patch it on the version read, and
//! read again when someone else wrote in between (409). The ConfigMap and the PDB use it.

use std::fmt::Debug;
use std::time::Duration;

use ::kube::api::Api;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tracing::{debug, info};

use super::machines::{KubeCall, is_status, post_params, send_merge_patch};

/// Errors keeping an object in step.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// Every attempt met a concurrent change.
    #[error("{what}: still conflicting after {attempts} attempts")]
    Conflict {
        /// The object.
        what: String,
        /// Attempts made.
        attempts: u32,
    },
    /// The API server refused or could not be reached.
    #[error(transparent)]
    Api(#[from] KubeCall),
}

impl SyncError {
    /// Whether trying again later may succeed without anyone changing anything.
    pub fn is_transient(&self) -> bool {
        match self {
            SyncError::Conflict { .. } => true,
            SyncError::Api(c) => c.is_transient(),
        }
    }
}

/// Attempts at one change before giving up until the next reconcile.
pub const ATTEMPTS: u32 = 5;

/// Makes the object `name` what `desired` and `patch` say: creates `desired()` when missing;
/// else `patch(current)` is the merge patch to send (carrying the resourceVersion read), `None`
/// when the object is already right. Returns whether anything was written.
pub async fn upsert<K>(
    api: &Api<K>,
    name: &str,
    desired: impl Fn() -> K,
    patch: impl Fn(&K) -> Option<Value>,
) -> Result<bool, SyncError>
where
    K: ::kube::Resource + Clone + DeserializeOwned + Serialize + Debug,
{
    let call = |what: &str, source| KubeCall {
        what: format!("{what} {name}"),
        source,
    };
    for attempt in 1..=ATTEMPTS {
        let current = api.get_opt(name).await.map_err(|e| call("reading", e))?;
        let written = match current {
            None => {
                let pp = post_params();
                api.create(&pp, &desired()).await.map(|_| "created")
            }
            Some(current) => {
                let Some(p) = patch(&current) else {
                    return Ok(false);
                };
                send_merge_patch(api, name, &p).await.map(|_| "updated")
            }
        };
        match written {
            Ok(how) => {
                info!(object = %name, "{how}");
                return Ok(true);
            }
            // A conflict, an AlreadyExists, or gone between read and write: read again.
            Err(e) if is_status(&e, 409) || is_status(&e, 404) => {
                debug!(object = %name, attempt, error = %e, "changed meanwhile; reading again");
                tokio::time::sleep(Duration::from_millis(20 * u64::from(attempt))).await;
            }
            Err(e) => return Err(call("writing", e).into()),
        }
    }
    Err(SyncError::Conflict {
        what: name.to_owned(),
        attempts: ATTEMPTS,
    })
}
