//! etcd-backup-restore's store selection (`--storage-provider`, `--store-container`,
//! `--store-prefix`, `--store-endpoint-override`, `STORAGE_CONTAINER`) and the credential
//! Secrets druid mounts (`<PROVIDER>_APPLICATION_CREDENTIALS`, a directory of one-value files,
//! or `..._JSON`, one JSON file), as `[store]` keys; for `copy` the `source-` flags and the
//! `SOURCE_`-prefixed variables as `[source_store]`; for `server` the `secondary-` flags and the
//! `SECONDARY_`-prefixed variables as `[store.secondary]`.
//!
//! Objects land where etcd-backup-restore puts them: `<container>/<prefix>/v2/<name>`
//! (etcd-warden's store URL names the prefix; the `v2` is its layout's too). The Local provider's
//! root is `$HOME/<container>/<prefix>`, `$HOME` being the directory druid mounts the host path
//! under (`/home/nonroot` in the image, `/root` when run as root): the container is a directory
//! below `$HOME`, never an absolute path.
//!
//! Key files stay files (`access_key_id_file`, `account_key_file`, ...), so a rotated Secret is
//! read again on the next request, as etcd-backup-restore re-creates its client when the files
//! change. The JSON form is read once, at start. Values that configure rather than authenticate
//! (region, endpoint, path style) are read at start.
//!
//! What etcd-warden cannot honour is refused, naming the field: a credential field asking for
//! something it would silently not do (an SSE-C algorithm S3 does not know; an SSE-C key, a CA
//! or a web identity token in the Secret's JSON form, which holds no file to read) or a
//! provider it has no client for (Swift, OSS).

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{Environment, Given, Ignored, Subcommand, Translation, UsageError};
use crate::config::Override;

/// One store's flags and variables: the destination's or, for `copy`, the source's.
struct Side {
    /// `""` or `source-`.
    flag_prefix: &'static str,
    /// `""`, `SOURCE_`.
    env_prefix: &'static str,
    /// `store` or `source_store`.
    section: &'static str,
}

const DEST: Side = Side {
    flag_prefix: "",
    env_prefix: "",
    section: "store",
};
const SOURCE: Side = Side {
    flag_prefix: "source-",
    env_prefix: "SOURCE_",
    section: "source_store",
};
/// `server`'s secondary store: etcd-backup-restore's `secondary-` flags and its
/// `SECONDARY_`-prefixed variables (`SECONDARY_STORAGE_CONTAINER`,
/// `SECONDARY_AWS_APPLICATION_CREDENTIALS`, ...).
const SECONDARY: Side = Side {
    flag_prefix: "secondary-",
    env_prefix: "SECONDARY_",
    section: "store.secondary",
};

/// etcd-backup-restore's smallest multipart chunk (`MinChunkSize`, 5 MiB), which it requires
/// of `--secondary-min-chunk-size` when the secondary is enabled.
const MIN_CHUNK_SIZE: i64 = 5 * 1024 * 1024;

/// `store.secondary.max_lag` when etcd-warden's own default applies (its validation's).
const SECONDARY_MAX_LAG: std::time::Duration = std::time::Duration::from_secs(15 * 60);

/// The store flags as given (the empty string where a flag was left out).
#[derive(Debug, Clone, Default)]
struct Selection {
    provider: String,
    container: String,
    prefix: String,
    endpoint: String,
}

fn selection(given: &Given, side: &Side, env: &dyn Environment) -> Selection {
    let flag = |name: &str| {
        given
            .get(format!("{}{name}", side.flag_prefix).as_str())
            .and_then(|v| v.last())
            .cloned()
            .unwrap_or_default()
    };
    let mut container = flag("store-container");
    if container.is_empty() {
        container = env
            .var(&format!("{}STORAGE_CONTAINER", side.env_prefix))
            .unwrap_or_default();
    }
    Selection {
        provider: flag("storage-provider"),
        container,
        prefix: flag("store-prefix"),
        endpoint: flag("store-endpoint-override"),
    }
}

/// Adds the store keys of the command line to `t`.
pub fn translate(
    t: &mut Translation,
    given: &Given,
    env: &dyn Environment,
) -> Result<(), UsageError> {
    let dest = selection(given, &DEST, env);
    if dest.provider.is_empty() {
        return Err(UsageError(
            "--storage-provider is required: etcd-warden always keeps snapshots in a store \
             (S3, ABS, GCS, OCS, ECS or Local)"
                .into(),
        ));
    }
    store(t, &DEST, &dest, env)?;
    if t.command == Subcommand::Copy {
        // An empty source provider or prefix is the destination's, as etcd-backup-restore
        // takes it.
        let mut source = selection(given, &SOURCE, env);
        if source.provider.is_empty() {
            source.provider = dest.provider.clone();
        }
        if source.prefix.is_empty() {
            source.prefix = dest.prefix.clone();
        }
        store(t, &SOURCE, &source, env)?;
    }
    if t.command == Subcommand::Server {
        secondary(t, given, env)?;
    }
    Ok(())
}

/// The secondary-store flags given, in the table's order.
fn secondary_flags(given: &Given) -> Vec<&'static str> {
    given
        .keys()
        .copied()
        .filter(|n| n.starts_with(SECONDARY.flag_prefix))
        .collect()
}

/// `[store.secondary]` from the `secondary-` flags, as etcd-backup-restore reads them: without
/// `--secondary-backup-sync-enabled=true` they configure nothing (its default; they are only
/// reported), with it the secondary is a store of its own (its own provider, container, prefix
/// and `SECONDARY_` credentials; nothing is taken from the primary's flags).
fn secondary(t: &mut Translation, given: &Given, env: &dyn Environment) -> Result<(), UsageError> {
    let flags = secondary_flags(given);
    let last = |name: &str| given.get(name).and_then(|v| v.last()).map(String::as_str);
    let enabled = last("secondary-backup-sync-enabled")
        .and_then(super::go_bool)
        .unwrap_or(false);
    if !enabled {
        for flag in flags {
            t.ignored.push(Ignored {
                flag: format!("--{flag}"),
                reason: "no secondary store without --secondary-backup-sync-enabled=true, as in \
                         etcd-backup-restore",
            });
        }
        return Ok(());
    }
    let invalid = |flag: &str, value: &str, why: &str| {
        UsageError(format!("invalid argument {value:?} for --{flag}: {why}"))
    };
    let sel = selection(given, &SECONDARY, env);
    if sel.provider.is_empty() {
        // etcd-backup-restore would open the Local default, `$HOME/default.bkp`, which is
        // where a Local primary without a container writes too: a copy onto itself.
        return Err(UsageError(
            "--secondary-backup-sync-enabled=true needs --secondary-storage-provider (S3, ABS, \
             GCS, OCS, ECS or Local) and the secondary's container"
                .into(),
        ));
    }
    // The chunking flags have no effect here; etcd-backup-restore still refuses to start on
    // values it cannot use, and so does this, so a command line means the same to both.
    if let Some(v) = last("secondary-max-parallel-chunk-uploads") {
        match v.trim().parse::<u64>() {
            Ok(n) if n > 0 => {}
            _ => {
                return Err(invalid(
                    "secondary-max-parallel-chunk-uploads",
                    v,
                    "must be an integer greater than zero",
                ));
            }
        }
    }
    if let Some(v) = last("secondary-min-chunk-size") {
        match v.trim().parse::<i64>() {
            Ok(n) if n >= MIN_CHUNK_SIZE => {}
            _ => {
                return Err(invalid(
                    "secondary-min-chunk-size",
                    v,
                    "must be a byte count of at least 5242880 (5 MiB)",
                ));
            }
        }
    }
    let before = t.overrides.len();
    store(t, &SECONDARY, &sel, env)?;
    same_store_refused(t, before)?;
    if let Some(v) = last("secondary-backup-sync-period") {
        let period =
            super::go_duration(v).map_err(|e| invalid("secondary-backup-sync-period", v, &e))?;
        if period.is_zero() {
            return Err(invalid(
                "secondary-backup-sync-period",
                v,
                "must be longer than zero",
            ));
        }
        let origin = "etcdbrctl --secondary-backup-sync-period";
        t.overrides.push(Override::flag(
            "store.secondary.sync_interval",
            super::duration_value(period),
            origin,
        ));
        // A snapshot may wait a whole period for the next pass and that pass's copy: with a
        // long period the lag alert is held to two periods, so it does not fire on every
        // healthy cycle.
        let lag = period.saturating_mul(2);
        if lag > SECONDARY_MAX_LAG {
            t.overrides.push(Override::flag(
                "store.secondary.max_lag",
                super::duration_value(lag),
                origin,
            ));
        }
    }
    for (flag, reason) in [
        (
            "secondary-max-parallel-chunk-uploads",
            "parts are uploaded as etcd-warden's store writer schedules them",
        ),
        (
            "secondary-min-chunk-size",
            "parts are uploaded as etcd-warden's store writer schedules them",
        ),
        (
            "secondary-snapstore-temp-directory",
            "uploads and downloads are streamed; nothing is staged on disk",
        ),
    ] {
        if given.contains_key(flag) {
            t.ignored.push(Ignored {
                flag: format!("--{flag}"),
                reason,
            });
        }
    }
    Ok(())
}

/// Refuses a secondary (the overrides from `from` on) that is the primary store or lies inside
/// it or around it: the copies would land among the originals, protecting nothing, and each
/// side's retention would delete the other's objects.
fn same_store_refused(t: &Translation, from: usize) -> Result<(), UsageError> {
    let primary = |key: &str| {
        t.overrides[..from]
            .iter()
            .rev()
            .find(|o| o.key == format!("store.{key}"))
            .map(|o| o.value.trim_end_matches('/').to_string())
    };
    let secondary = |key: &str| {
        t.overrides[from..]
            .iter()
            .rev()
            .find(|o| o.key == format!("store.secondary.{key}"))
            .map(|o| o.value.trim_end_matches('/').to_string())
    };
    let (Some(p), Some(s)) = (primary("url"), secondary("url")) else {
        return Ok(());
    };
    let nested = p == s || s.starts_with(&format!("{p}/")) || p.starts_with(&format!("{s}/"));
    // A bucket of the same name behind another endpoint or account is another store.
    let same_place = ["endpoint", "account_name"]
        .iter()
        .all(|k| primary(k) == secondary(k));
    if nested && same_place {
        return Err(UsageError(format!(
            "the secondary store {s} is the primary store {p} or overlaps it: give \
             --secondary-store-container or --secondary-store-prefix a place of its own"
        )));
    }
    Ok(())
}

fn store(
    t: &mut Translation,
    side: &Side,
    s: &Selection,
    env: &dyn Environment,
) -> Result<(), UsageError> {
    let origin = format!("etcdbrctl --{}storage-provider", side.flag_prefix);
    let mut keys: Vec<(&str, String)> = Vec::new();
    let prefix = s.prefix.trim_matches('/');
    match s.provider.as_str() {
        "Local" => {
            let home = env.var("HOME").filter(|h| !h.is_empty()).ok_or_else(|| {
                UsageError(
                    "HOME is not set: the Local provider keeps snapshots under \
                     $HOME/<container>/<prefix>"
                        .into(),
                )
            })?;
            let container = if s.container.is_empty() {
                "default.bkp"
            } else {
                s.container.trim_start_matches('/')
            };
            let mut root = PathBuf::from(home).join(container);
            if !prefix.is_empty() {
                root = root.join(prefix);
            }
            keys.push(("url", format!("file://{}", root.display())));
        }
        "S3" | "OCS" | "ECS" => {
            keys.push(("url", bucket_url("s3", side, s, prefix)?));
            keys.extend(s3(t, side, s, env)?);
        }
        "ABS" => {
            keys.push(("url", bucket_url("az", side, s, prefix)?));
            keys.extend(azure(side, s, env)?);
        }
        "GCS" => {
            keys.push(("url", bucket_url("gs", side, s, prefix)?));
            keys.extend(gcs(side, s, env)?);
        }
        "Swift" | "OSS" => {
            return Err(UsageError(format!(
                "--{}storage-provider={}: etcd-warden has no client for this store; it supports \
                 S3, OCS, ECS (S3-compatible), ABS, GCS and Local",
                side.flag_prefix, s.provider
            )));
        }
        other => {
            return Err(UsageError(format!(
                "invalid argument {other:?} for --{}storage-provider: expected S3, ABS, GCS, \
                 Swift, OSS, ECS, OCS or Local",
                side.flag_prefix
            )));
        }
    }
    for (key, value) in keys {
        t.overrides.push(Override::flag(
            &format!("{}.{key}", side.section),
            value,
            &origin,
        ));
    }
    Ok(())
}

fn bucket_url(
    scheme: &str,
    side: &Side,
    s: &Selection,
    prefix: &str,
) -> Result<String, UsageError> {
    if s.container.is_empty() {
        return Err(UsageError(format!(
            "the {} store needs a container: --{}store-container or {}STORAGE_CONTAINER",
            s.provider, side.flag_prefix, side.env_prefix
        )));
    }
    Ok(if prefix.is_empty() {
        format!("{scheme}://{}", s.container)
    } else {
        format!("{scheme}://{}/{prefix}", s.container)
    })
}

/// One credential field: a file in the Secret's directory (named by path, so it is re-read),
/// or a value of its JSON form.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Field {
    File(PathBuf),
    Value(String),
}

impl Field {
    /// The field's value now (for what is read once at start).
    fn read(&self) -> Result<String, UsageError> {
        match self {
            Field::Value(v) => Ok(v.clone()),
            Field::File(p) => std::fs::read_to_string(p)
                .map(|v| v.trim_end_matches(['\r', '\n']).to_string())
                .map_err(|e| UsageError(format!("cannot read {}: {e}", p.display()))),
        }
    }

    /// As a secret: its `file_key` (`…_file`, re-read when the file changes) for a file,
    /// `key` for a value.
    fn secret(&self, key: &'static str, file_key: &'static str) -> (&'static str, String) {
        match self {
            Field::File(p) => (file_key, p.display().to_string()),
            Field::Value(v) => (key, v.clone()),
        }
    }
}

/// A provider's credentials as druid mounts them; empty when neither variable names anything
/// that exists (the pod's ambient identity then applies, as with etcd-backup-restore's default
/// chain).
struct Credentials {
    /// Where they came from, for messages.
    source: String,
    fields: std::collections::BTreeMap<String, Field>,
}

impl Credentials {
    fn read(side: &Side, provider_var: &str, env: &dyn Environment) -> Result<Self, UsageError> {
        let dir_var = format!("{}{provider_var}_APPLICATION_CREDENTIALS", side.env_prefix);
        let json_var = format!("{dir_var}_JSON");
        let mut fields = std::collections::BTreeMap::new();
        if let Some(json) = env.var(&json_var).filter(|v| !v.is_empty()) {
            return Self::from_json(Path::new(&json), &json_var);
        }
        let Some(dir) = env.var(&dir_var).filter(|v| !v.is_empty()) else {
            return Ok(Credentials {
                source: String::new(),
                fields,
            });
        };
        let dir = PathBuf::from(dir);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            // druid sets the variable even when no Secret is mounted: ambient credentials.
            return Ok(Credentials {
                source: String::new(),
                fields,
            });
        };
        let mut names: Vec<PathBuf> = entries.filter_map(Result::ok).map(|e| e.path()).collect();
        names.sort();
        // etcd-backup-restore's legacy layout: a JSON file in the directory is the credentials.
        if let Some(json) = names
            .iter()
            .find(|p| p.extension().is_some_and(|e| e == "json") && p.is_file())
        {
            return Self::from_json(json, &dir_var);
        }
        for p in names {
            // A mounted Secret's entries are symlinks to files; `..data` and friends are
            // directories.
            let Some(name) = p.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if name.starts_with('.') || !p.is_file() {
                continue;
            }
            fields.insert(name.to_string(), Field::File(p.clone()));
        }
        Ok(Credentials {
            source: format!("{} ({dir_var})", dir.display()),
            fields,
        })
    }

    fn from_json(path: &Path, var: &str) -> Result<Self, UsageError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| UsageError(format!("cannot read {} ({var}): {e}", path.display())))?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| UsageError(format!("{} ({var}) is not JSON: {e}", path.display())))?;
        let Value::Object(map) = value else {
            return Err(UsageError(format!(
                "{} ({var}) is not a JSON object",
                path.display()
            )));
        };
        let fields = map
            .into_iter()
            .map(|(k, v)| {
                let text = match v {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                (k, Field::Value(text))
            })
            .collect();
        Ok(Credentials {
            source: format!("{} ({var})", path.display()),
            fields,
        })
    }

    fn get(&self, name: &str) -> Option<&Field> {
        self.fields.get(name)
    }

    fn value(&self, name: &str) -> Result<Option<String>, UsageError> {
        self.get(name).map(Field::read).transpose()
    }

    fn flag(&self, name: &str) -> Result<bool, UsageError> {
        match self.value(name)? {
            None => Ok(false),
            Some(v) => super::go_bool(v.trim()).ok_or_else(|| {
                UsageError(format!("{name} in {}: {v:?} is not a boolean", self.source))
            }),
        }
    }
}

/// What an S3-compatible store's credentials say.
struct S3Settings {
    endpoint: Option<String>,
    region: Option<String>,
    path_style: bool,
    allow_http: bool,
    key_pair: Option<(Field, Field)>,
    /// `roleARN` and the path of the `token` file.
    web_identity: Option<(String, PathBuf)>,
    /// `trustedCaCert`'s file.
    ca_file: Option<PathBuf>,
    /// `sseCustomerKey`'s file (SSE-C).
    sse_customer_key_file: Option<PathBuf>,
}

/// ECS is configured by variables, not files; its region is fixed and it is addressed
/// path-style.
fn ecs(side: &Side, env: &dyn Environment) -> S3Settings {
    let var = |n: &str| env.var(&format!("{}ECS_{n}", side.env_prefix));
    S3Settings {
        endpoint: var("ENDPOINT"),
        region: Some("US-Standard".to_string()),
        path_style: true,
        allow_http: var("DISABLE_SSL").is_some_and(|v| super::go_bool(&v) == Some(true)),
        key_pair: var("ACCESS_KEY_ID")
            .zip(var("SECRET_ACCESS_KEY"))
            .map(|(id, secret)| (Field::Value(id), Field::Value(secret))),
        web_identity: None,
        ca_file: None,
        sse_customer_key_file: None,
    }
}

/// S3 and OCS: the Secret's files or JSON.
fn s3_secret(
    t: &mut Translation,
    side: &Side,
    ocs: bool,
    env: &dyn Environment,
) -> Result<S3Settings, UsageError> {
    let c = Credentials::read(side, if ocs { "OPENSHIFT" } else { "AWS" }, env)?;
    // A CA and a web identity token are files etcd-warden reads itself (again on rotation):
    // only the Secret's directory form gives their paths.
    let file = |name: &str| -> Result<Option<PathBuf>, UsageError> {
        match c.get(name) {
            None => Ok(None),
            Some(Field::File(p)) => Ok(Some(p.clone())),
            Some(Field::Value(_)) => Err(UsageError(format!(
                "{name} in {}: give the Secret as a directory of files (…_APPLICATION_CREDENTIALS) \
                 for a {name}: etcd-warden reads it as a file",
                c.source
            ))),
        }
    };
    let ca_file = file("trustedCaCert")?;
    let sse_customer_key_file = file("sseCustomerKey")?;
    if let Some(algorithm) = c.value("sseCustomerAlgorithm")?
        && algorithm.trim() != "AES256"
    {
        return Err(UsageError(format!(
            "sseCustomerAlgorithm in {}: {algorithm:?}; S3 knows only AES256",
            c.source
        )));
    }
    let web_identity = match (c.value("roleARN")?, file("token")?) {
        (Some(role), Some(token)) => Some((role, token)),
        (None, _) => None,
        (Some(_), None) => {
            return Err(UsageError(format!(
                "roleARN in {}: needs the file token beside it (the web identity token)",
                c.source
            )));
        }
    };
    for ignored in [
        "insecureSkipVerify",
        "requestChecksumCalculation",
        "responseChecksumValidation",
    ] {
        if c.get(ignored).is_some() {
            t.ignored.push(Ignored {
                flag: format!("{ignored} in {}", c.source),
                reason: "etcd-warden always verifies the store's certificate and checks every \
                         object's hash itself",
            });
        }
    }
    Ok(S3Settings {
        endpoint: c.value("endpoint")?.filter(|e| !e.is_empty()),
        region: c.value("region")?,
        // OCS is always addressed path-style by etcd-backup-restore.
        path_style: ocs || c.flag("s3ForcePathStyle")?,
        allow_http: c.flag("disableSSL")?,
        key_pair: c
            .get("accessKeyID")
            .cloned()
            .zip(c.get("secretAccessKey").cloned()),
        web_identity,
        ca_file,
        sse_customer_key_file,
    })
}

/// S3 and the S3-compatible OCS and ECS.
fn s3(
    t: &mut Translation,
    side: &Side,
    s: &Selection,
    env: &dyn Environment,
) -> Result<Vec<(&'static str, String)>, UsageError> {
    let mut st = match s.provider.as_str() {
        "ECS" => ecs(side, env),
        p => s3_secret(t, side, p == "OCS", env)?,
    };
    if !s.endpoint.is_empty() {
        st.endpoint = Some(s.endpoint.clone());
    }
    let mut keys: Vec<(&'static str, String)> = Vec::new();
    if let Some(r) = st.region {
        keys.push(("region", r));
    }
    if let Some(e) = st.endpoint {
        if st.allow_http || e.starts_with("http://") {
            keys.push(("allow_http", "true".into()));
        }
        keys.push(("endpoint", e));
    }
    keys.push(("path_style", st.path_style.to_string()));
    match (st.key_pair, st.web_identity) {
        (Some((id, secret)), _) => {
            keys.push(id.secret("access_key_id", "access_key_id_file"));
            keys.push(secret.secret("secret_access_key", "secret_access_key_file"));
        }
        (None, Some((role, token))) => {
            keys.push(("role_arn", role));
            keys.push(("web_identity_token_file", token.display().to_string()));
        }
        (None, None) => {}
    }
    if let Some(ca) = st.ca_file {
        keys.push(("ca_file", ca.display().to_string()));
    }
    if let Some(key) = st.sse_customer_key_file {
        keys.push(("server_side_encryption", "sse-c".into()));
        keys.push(("sse_customer_key_file", key.display().to_string()));
    }
    Ok(keys)
}

/// Azure Blob Storage: `storageAccount`, `storageKey`, and `domain` (a sovereign cloud).
fn azure(
    side: &Side,
    s: &Selection,
    env: &dyn Environment,
) -> Result<Vec<(&'static str, String)>, UsageError> {
    let c = Credentials::read(side, "AZURE", env)?;
    let mut keys: Vec<(&'static str, String)> = Vec::new();
    let account = c.value("storageAccount")?;
    if let Some(a) = &account {
        keys.push(("account_name", a.clone()));
    }
    if let Some(key) = c.get("storageKey") {
        keys.push(key.secret("account_key", "account_key_file"));
    }
    let domain = c.value("domain")?.filter(|d| !d.is_empty());
    if !s.endpoint.is_empty() {
        keys.push(("endpoint", s.endpoint.clone()));
    } else if let (Some(domain), Some(account)) = (domain, &account)
        && domain != "blob.core.windows.net"
    {
        keys.push(("endpoint", format!("https://{account}.{domain}")));
    }
    Ok(keys)
}

/// Google Cloud Storage: a service account key file.
fn gcs(
    side: &Side,
    s: &Selection,
    env: &dyn Environment,
) -> Result<Vec<(&'static str, String)>, UsageError> {
    if !s.endpoint.is_empty() {
        return Err(UsageError(format!(
            "--{}store-endpoint-override is not supported for GCS",
            side.flag_prefix
        )));
    }
    let var = format!("{}GOOGLE_APPLICATION_CREDENTIALS", side.env_prefix);
    let Some(path) = env.var(&var).filter(|p| !p.is_empty()) else {
        return Ok(Vec::new());
    };
    let Ok(text) = std::fs::read_to_string(&path) else {
        // Set but not mounted: the pod's ambient identity.
        return Ok(Vec::new());
    };
    let kind = serde_json::from_str::<Value>(&text)
        .ok()
        .and_then(|v| v.get("type").and_then(Value::as_str).map(str::to_string));
    match kind.as_deref() {
        Some("service_account") => Ok(vec![("service_account_file", path)]),
        other => Err(UsageError(format!(
            "{path} ({var}): credentials of type {} are not supported; give a service account \
             key (\"type\": \"service_account\") or leave the variable unset for the pod's \
             workload identity",
            other.map_or("(none)".to_string(), |k| format!("{k:?}"))
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn run(
        command: Subcommand,
        line: &str,
        vars: &HashMap<&str, String>,
    ) -> Result<Translation, UsageError> {
        let args: Vec<String> = std::iter::once(command.name())
            .chain(line.split_whitespace())
            .map(str::to_string)
            .collect();
        let env = |k: &str| vars.get(k).cloned();
        super::super::translate(&args, &env)
    }

    #[test]
    fn local_is_a_directory_below_home() {
        let vars = HashMap::from([
            ("HOME", "/home/nonroot".to_string()),
            ("STORAGE_CONTAINER", "bkp".to_string()),
        ]);
        let t = run(
            Subcommand::Restore,
            "--storage-provider=Local --store-prefix=etcd-main",
            &vars,
        )
        .unwrap();
        assert_eq!(
            t.value("store.url"),
            Some("file:///home/nonroot/bkp/etcd-main")
        );
        let t = run(
            Subcommand::Restore,
            "--storage-provider=Local --store-container=/abs",
            &vars,
        )
        .unwrap();
        assert_eq!(t.value("store.url"), Some("file:///home/nonroot/abs"));
        let none = HashMap::from([("HOME", "/root".to_string())]);
        let t = run(Subcommand::Restore, "--storage-provider=Local", &none).unwrap();
        assert_eq!(t.value("store.url"), Some("file:///root/default.bkp"));
    }

    #[test]
    fn s3_files_are_kept_as_files_and_the_json_form_as_values() {
        let dir = tempfile::tempdir().unwrap();
        for (name, value) in [
            ("region", "eu-west-1\n"),
            ("accessKeyID", "AKIA"),
            ("secretAccessKey", "s3cr3t"),
            ("endpoint", "http://127.0.0.1:9000"),
            ("s3ForcePathStyle", "true"),
        ] {
            std::fs::write(dir.path().join(name), value).unwrap();
        }
        let vars = HashMap::from([
            (
                "AWS_APPLICATION_CREDENTIALS",
                dir.path().display().to_string(),
            ),
            ("STORAGE_CONTAINER", "bucket".to_string()),
        ]);
        let t = run(
            Subcommand::Restore,
            "--storage-provider=S3 --store-prefix=p/q",
            &vars,
        )
        .unwrap();
        assert_eq!(t.value("store.url"), Some("s3://bucket/p/q"));
        assert_eq!(t.value("store.region"), Some("eu-west-1"));
        assert_eq!(t.value("store.endpoint"), Some("http://127.0.0.1:9000"));
        assert_eq!(t.value("store.allow_http"), Some("true"));
        assert_eq!(t.value("store.path_style"), Some("true"));
        let id = dir.path().join("accessKeyID").display().to_string();
        assert_eq!(t.value("store.access_key_id_file"), Some(id.as_str()));

        let json = dir.path().join("creds.json");
        std::fs::write(
            &json,
            r#"{"region":"us-east-1","accessKeyID":"A","secretAccessKey":"B"}"#,
        )
        .unwrap();
        let vars = HashMap::from([
            (
                "AWS_APPLICATION_CREDENTIALS_JSON",
                json.display().to_string(),
            ),
            ("STORAGE_CONTAINER", "bucket".to_string()),
        ]);
        let t = run(Subcommand::Restore, "--storage-provider=S3", &vars).unwrap();
        assert_eq!(t.value("store.access_key_id"), Some("A"));
        assert_eq!(t.value("store.secret_access_key"), Some("B"));
        assert_eq!(t.value("store.path_style"), Some("false"));
    }

    #[test]
    fn what_cannot_be_honoured_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("sseCustomerAlgorithm"), "aws:kms").unwrap();
        let vars = HashMap::from([
            (
                "AWS_APPLICATION_CREDENTIALS",
                dir.path().display().to_string(),
            ),
            ("STORAGE_CONTAINER", "bucket".to_string()),
        ]);
        let e = run(Subcommand::Restore, "--storage-provider=S3", &vars).unwrap_err();
        assert!(e.0.contains("sseCustomerAlgorithm"), "{e}");
        let none = HashMap::new();
        let e = run(Subcommand::Restore, "--storage-provider=S3", &none).unwrap_err();
        assert!(e.0.contains("STORAGE_CONTAINER"), "{e}");
        let e = run(
            Subcommand::Restore,
            "--storage-provider=Swift --store-container=c",
            &none,
        )
        .unwrap_err();
        assert!(e.0.contains("Swift"), "{e}");
        let e = run(Subcommand::Restore, "--store-prefix=x", &none).unwrap_err();
        assert!(e.0.contains("--storage-provider"), "{e}");
    }

    #[test]
    fn a_web_identity_and_a_ca_in_the_secret_are_files_etcd_warden_reads() {
        let dir = tempfile::tempdir().unwrap();
        for (name, value) in [
            ("region", "eu-west-1"),
            ("roleARN", "arn:aws:iam::1:role/etcd"),
            ("token", "jwt"),
            ("trustedCaCert", "-----BEGIN CERTIFICATE-----"),
        ] {
            std::fs::write(dir.path().join(name), value).unwrap();
        }
        let vars = HashMap::from([
            (
                "AWS_APPLICATION_CREDENTIALS",
                dir.path().display().to_string(),
            ),
            ("STORAGE_CONTAINER", "bucket".to_string()),
        ]);
        let t = run(Subcommand::Restore, "--storage-provider=S3", &vars).unwrap();
        assert_eq!(t.value("store.role_arn"), Some("arn:aws:iam::1:role/etcd"));
        let token = dir.path().join("token").display().to_string();
        assert_eq!(
            t.value("store.web_identity_token_file"),
            Some(token.as_str())
        );
        let ca = dir.path().join("trustedCaCert").display().to_string();
        assert_eq!(t.value("store.ca_file"), Some(ca.as_str()));
        assert_eq!(t.value("store.server_side_encryption"), None);
        // SSE-C: the key stays a file etcd-warden reads.
        std::fs::write(dir.path().join("sseCustomerKey"), [7u8; 32]).unwrap();
        std::fs::write(dir.path().join("sseCustomerAlgorithm"), "AES256").unwrap();
        let t = run(Subcommand::Restore, "--storage-provider=S3", &vars).unwrap();
        assert_eq!(t.value("store.server_side_encryption"), Some("sse-c"));
        let key = dir.path().join("sseCustomerKey").display().to_string();
        assert_eq!(t.value("store.sse_customer_key_file"), Some(key.as_str()));
        std::fs::remove_file(dir.path().join("token")).unwrap();
        let e = run(Subcommand::Restore, "--storage-provider=S3", &vars).unwrap_err();
        assert!(e.0.contains("token"), "{e}");
    }

    #[test]
    fn a_missing_secret_directory_means_the_ambient_identity() {
        let vars = HashMap::from([
            (
                "AWS_APPLICATION_CREDENTIALS",
                "/nonexistent/etcd-backup".to_string(),
            ),
            ("STORAGE_CONTAINER", "bucket".to_string()),
        ]);
        let t = run(Subcommand::Restore, "--storage-provider=S3", &vars).unwrap();
        assert_eq!(t.value("store.access_key_id"), None);
        assert_eq!(t.value("store.access_key_id_file"), None);
    }

    /// `server`'s primary store in these tests: S3 with druid's variables.
    const PRIMARY: &str = "--storage-provider=S3 --store-prefix=etcd-main";

    #[test]
    fn secondary_flags_are_store_secondary_with_their_own_credentials() {
        let dir = tempfile::tempdir().unwrap();
        let secondary = dir.path().join("secondary");
        std::fs::create_dir(&secondary).unwrap();
        for (name, value) in [
            ("region", "eu-central-1"),
            ("accessKeyID", "SECONDARY-ID"),
            ("secretAccessKey", "secondary-secret"),
        ] {
            std::fs::write(secondary.join(name), value).unwrap();
        }
        let vars = HashMap::from([
            ("STORAGE_CONTAINER", "primary-bucket".to_string()),
            (
                "SECONDARY_AWS_APPLICATION_CREDENTIALS",
                secondary.display().to_string(),
            ),
            ("SECONDARY_STORAGE_CONTAINER", "dr-bucket".to_string()),
            ("HOME", "/home/nonroot".to_string()),
        ]);
        let t = run(
            Subcommand::Server,
            &format!(
                "{PRIMARY} --secondary-backup-sync-enabled=true --secondary-storage-provider=S3 \
                 --secondary-store-prefix=/dr/etcd-main/ \
                 --secondary-store-endpoint-override=http://127.0.0.1:9000 \
                 --secondary-backup-sync-period=2h0m0s \
                 --secondary-max-parallel-chunk-uploads=3 --secondary-min-chunk-size=5242880 \
                 --secondary-snapstore-temp-directory=/var/etcd/data/temp2"
            ),
            &vars,
        )
        .unwrap();
        assert_eq!(t.value("store.url"), Some("s3://primary-bucket/etcd-main"));
        assert_eq!(
            t.value("store.secondary.url"),
            Some("s3://dr-bucket/dr/etcd-main")
        );
        assert_eq!(t.value("store.secondary.region"), Some("eu-central-1"));
        assert_eq!(
            t.value("store.secondary.endpoint"),
            Some("http://127.0.0.1:9000")
        );
        assert_eq!(t.value("store.secondary.allow_http"), Some("true"));
        // The secondary's own Secret, kept as files so a rotation is read again.
        let id = secondary.join("accessKeyID").display().to_string();
        assert_eq!(
            t.value("store.secondary.access_key_id_file"),
            Some(id.as_str())
        );
        assert_eq!(t.value("store.access_key_id_file"), None);
        assert_eq!(t.value("store.secondary.sync_interval"), Some("7200000ms"));
        // A pass every two hours: the lag alert allows two periods, not the default 15m.
        assert_eq!(t.value("store.secondary.max_lag"), Some("14400000ms"));
        let ignored: Vec<&str> = t.ignored.iter().map(|i| i.flag.as_str()).collect();
        for flag in [
            "--secondary-max-parallel-chunk-uploads",
            "--secondary-min-chunk-size",
            "--secondary-snapstore-temp-directory",
        ] {
            assert!(ignored.contains(&flag), "{flag}: {ignored:?}");
        }

        // Local: below $HOME as the primary's; etcd-backup-restore's period unless given.
        let t = run(
            Subcommand::Server,
            &format!(
                "{PRIMARY} --secondary-backup-sync-enabled --secondary-storage-provider=Local \
                 --secondary-store-container=mirror"
            ),
            &vars,
        )
        .unwrap();
        assert_eq!(
            t.value("store.secondary.url"),
            Some("file:///home/nonroot/mirror")
        );
        assert_eq!(t.value("store.secondary.sync_interval"), None);
    }

    #[test]
    fn secondary_flags_without_sync_enabled_configure_nothing() {
        let vars = HashMap::from([("STORAGE_CONTAINER", "primary-bucket".to_string())]);
        for enabled in ["", "--secondary-backup-sync-enabled=false"] {
            let t = run(
                Subcommand::Server,
                &format!(
                    "{PRIMARY} {enabled} --secondary-storage-provider=S3 \
                     --secondary-store-container=dr --secondary-min-chunk-size=1"
                ),
                &vars,
            )
            .unwrap();
            assert!(
                !t.overrides
                    .iter()
                    .any(|o| o.key.starts_with("store.secondary")),
                "{enabled:?}: {:?}",
                t.overrides
            );
            let ignored: Vec<&str> = t.ignored.iter().map(|i| i.flag.as_str()).collect();
            assert!(
                ignored.contains(&"--secondary-storage-provider"),
                "{ignored:?}"
            );
        }
    }

    #[test]
    fn an_invalid_secondary_combination_is_refused_naming_the_flag() {
        let vars = HashMap::from([
            ("STORAGE_CONTAINER", "primary-bucket".to_string()),
            ("HOME", "/home/nonroot".to_string()),
        ]);
        let on = "--secondary-backup-sync-enabled=true";
        for (flags, named) in [
            // etcd-backup-restore would take $HOME/default.bkp unasked.
            (on.to_string(), "--secondary-storage-provider"),
            (
                format!("{on} --secondary-storage-provider=S3"),
                "--secondary-store-container",
            ),
            (
                format!("{on} --secondary-storage-provider=Swift --secondary-store-container=c"),
                "--secondary-storage-provider=Swift",
            ),
            (
                format!("{on} --secondary-storage-provider=Nope --secondary-store-container=c"),
                "--secondary-storage-provider",
            ),
            (
                format!(
                    "{on} --secondary-storage-provider=S3 --secondary-store-container=primary-bucket \
                     --secondary-store-prefix=etcd-main"
                ),
                "--secondary-store-prefix",
            ),
            (
                format!(
                    "{on} --secondary-storage-provider=S3 --secondary-store-container=primary-bucket"
                ),
                "--secondary-store-prefix",
            ),
            (
                format!(
                    "{on} --secondary-storage-provider=S3 --secondary-store-container=dr \
                     --secondary-backup-sync-period=0s"
                ),
                "--secondary-backup-sync-period",
            ),
            (
                format!(
                    "{on} --secondary-storage-provider=S3 --secondary-store-container=dr \
                     --secondary-min-chunk-size=1024"
                ),
                "--secondary-min-chunk-size",
            ),
            (
                format!(
                    "{on} --secondary-storage-provider=S3 --secondary-store-container=dr \
                     --secondary-max-parallel-chunk-uploads=0"
                ),
                "--secondary-max-parallel-chunk-uploads",
            ),
            (
                format!(
                    "{on} --secondary-storage-provider=GCS --secondary-store-container=dr \
                     --secondary-store-endpoint-override=http://x"
                ),
                "--secondary-store-endpoint-override",
            ),
        ] {
            let e = run(Subcommand::Server, &format!("{PRIMARY} {flags}"), &vars).unwrap_err();
            assert!(e.0.contains(named), "{flags}: {e}");
        }
        // Two Local stores in one directory are one store.
        let home = HashMap::from([("HOME", "/home/nonroot".to_string())]);
        let e = run(
            Subcommand::Server,
            &format!("--storage-provider=Local {on} --secondary-storage-provider=Local"),
            &home,
        )
        .unwrap_err();
        assert!(e.0.contains("--secondary-store-container"), "{e}");
        // etcd-backup-restore defines them for `server` alone.
        let e = run(
            Subcommand::Snapshot,
            &format!("{PRIMARY} --secondary-storage-provider=S3"),
            &vars,
        )
        .unwrap_err();
        assert!(e.0.contains("--secondary-storage-provider"), "{e}");
    }

    #[test]
    fn copy_reads_the_source_with_its_prefix_and_falls_back_to_the_destination() {
        let vars = HashMap::from([
            ("HOME", "/home/nonroot".to_string()),
            ("STORAGE_CONTAINER", "dst".to_string()),
            ("SOURCE_STORAGE_CONTAINER", "src".to_string()),
        ]);
        let t = run(
            Subcommand::Copy,
            "--storage-provider=Local --store-prefix=p --source-store-prefix=q",
            &vars,
        )
        .unwrap();
        assert_eq!(t.value("store.url"), Some("file:///home/nonroot/dst/p"));
        assert_eq!(
            t.value("source_store.url"),
            Some("file:///home/nonroot/src/q")
        );
        let t = run(
            Subcommand::Copy,
            "--storage-provider=Local --store-prefix=p",
            &vars,
        )
        .unwrap();
        assert_eq!(
            t.value("source_store.url"),
            Some("file:///home/nonroot/src/p")
        );
    }
}
