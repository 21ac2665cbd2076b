//! The layers merged key by key (embedded defaults → file → `ETCD_WARDEN_*` environment → flags)
//! into one TOML table, with where each key's value came from, so that every error can name it.
//!
//! The sidecar's [`SIDECAR`] layout is one use; another program (the operator) describes its own
//! defaults and variable prefix in a [`Layout`] and gets the same layering, origins and errors
//! through [`Layered`].

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde::de::DeserializeOwned;

use super::raw::RawConfig;
use super::{ConfigError, DEFAULTS, ENV_PREFIX};

/// How one program's configuration is layered.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    /// The embedded defaults (TOML): the first layer.
    pub defaults: &'static str,
    /// Prefix of every environment variable that sets a key.
    pub env_prefix: &'static str,
    /// Variables with the prefix that are not keys (e.g. the one naming the file).
    pub env_not_keys: &'static [&'static str],
    /// Sections a `<PREFIX><SECTION>_<KEY>` variable can name.
    pub sections: &'static [&'static str],
    /// Whether a variable naming no section sets a top-level key (`<PREFIX><KEY>` sets `key`);
    /// otherwise it is refused.
    pub top_level: bool,
}

/// The sidecar's configuration (`etcd-warden`).
pub const SIDECAR: Layout = Layout {
    defaults: DEFAULTS,
    env_prefix: ENV_PREFIX,
    env_not_keys: &["ETCD_WARDEN_CONFIG"],
    sections: SECTIONS,
    top_level: false,
};

/// Where environment variables come from: the process, or a map in tests (so tests never mutate
/// the process environment).
pub trait EnvSource {
    /// Every variable as (name, value).
    fn vars(&self) -> Vec<(String, String)>;
}

/// The process environment.
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn vars(&self) -> Vec<(String, String)> {
        std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .collect()
    }
}

impl EnvSource for HashMap<String, String> {
    fn vars(&self) -> Vec<(String, String)> {
        self.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }
}

/// One value set from the command line: a dotted key, its value as text, and the flag's name.
#[derive(Debug, Clone)]
pub struct Override {
    /// Dotted key, e.g. `store.url`.
    pub key: String,
    /// The value as typed; parsed as the key's type during validation.
    pub value: String,
    /// Shown in errors, e.g. `--store`.
    pub origin: String,
}

impl Override {
    /// An override of `key` from the flag `flag`.
    pub fn flag(key: &str, value: impl Into<String>, flag: &str) -> Self {
        Self {
            key: key.into(),
            value: value.into(),
            origin: flag.into(),
        }
    }
}

/// The inputs of [`Config::load`](super::Config::load).
pub struct Sources<'a> {
    /// The `--config` file, if any.
    pub file: Option<&'a Path>,
    /// The environment.
    pub env: &'a dyn EnvSource,
    /// Flags, applied last.
    pub overrides: Vec<Override>,
}

/// The layers merged into one table, with where each key's value came from.
pub(super) struct Merged {
    table: toml::Table,
    origins: BTreeMap<String, String>,
}

impl Merged {
    pub(super) fn origin_of(&self, key: &str) -> String {
        // A key's own origin, else its section's (an override of a whole table); a list item
        // (`key[2]`) comes from where its list came from.
        let mut k = key.split('[').next().unwrap_or(key);
        loop {
            if let Some(o) = self.origins.get(k) {
                return format!(" (from {o})");
            }
            match k.rsplit_once('.') {
                Some((parent, _)) => k = parent,
                None => return String::new(),
            }
        }
    }

    pub(super) fn err(&self, key: &str, message: impl Into<String>) -> ConfigError {
        ConfigError {
            key: key.into(),
            origin: self.origin_of(key),
            message: message.into(),
        }
    }

    fn set(&mut self, key: &str, value: toml::Value, origin: String) -> Result<(), ConfigError> {
        let parts: Vec<&str> = key.split('.').collect();
        let (leaf, sections) = parts.split_last().expect("split yields at least one part");
        let mut table = &mut self.table;
        for (i, section) in sections.iter().enumerate() {
            let entry = table
                .entry(section.to_string())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            table = entry.as_table_mut().ok_or_else(|| {
                ConfigError::new(parts[..=i].join("."), "is a value, not a section")
            })?;
        }
        table.insert(leaf.to_string(), value);
        self.origins.insert(key.to_string(), origin);
        Ok(())
    }
}

fn merge(into: &mut toml::Table, from: toml::Table) {
    for (k, v) in from {
        match (into.get_mut(&k), v) {
            (Some(toml::Value::Table(dst)), toml::Value::Table(src)) => merge(dst, src),
            (_, v) => {
                into.insert(k, v);
            }
        }
    }
}

/// Sections a `ETCD_WARDEN_<SECTION>_<KEY>` variable can name.
const SECTIONS: &[&str] = &[
    "etcd",
    "store",
    "store.secondary",
    "source_store",
    "copy",
    "snapshot",
    "defrag",
    "owner",
    "kill",
    "server",
    "log",
    "restore",
    "quorum_restore",
    "encryption",
    "druid",
    "kubernetes",
];

/// Maps `ETCD_WARDEN_SNAPSHOT_DELTA_PERIOD` to `snapshot.delta_period` (with the sidecar's
/// layout).
fn env_key(layout: &Layout, var: &str) -> Option<String> {
    let rest = var.strip_prefix(layout.env_prefix)?.to_ascii_lowercase();
    // The longest matching section wins, so a section named like another's prefix (`store`,
    // `store_x`) cannot capture its variables.
    let sectioned = layout
        .sections
        .iter()
        .filter_map(|s| {
            // A subsection (`store.secondary`) is named with `_` in a variable.
            let key = rest.strip_prefix(&s.replace('.', "_"))?.strip_prefix('_')?;
            (!key.is_empty()).then(|| (s.len(), format!("{s}.{key}")))
        })
        .max_by_key(|(len, _)| *len)
        .map(|(_, key)| key);
    sectioned.or_else(|| (layout.top_level && !rest.is_empty()).then_some(rest))
}

/// The environment variable that sets a dotted key.
pub fn env_var_for(key: &str) -> String {
    format!("{ENV_PREFIX}{}", key.replace('.', "_").to_ascii_uppercase())
}

impl RawConfig {
    /// Merges the layers and deserializes them; unknown keys and wrongly typed values fail here.
    pub fn load(sources: &Sources<'_>) -> Result<RawConfig, ConfigError> {
        Merged::from_sources(&SIDECAR, sources)?.raw()
    }
}

/// Every layer of a [`Layout`] merged, remembering where each value came from.
pub struct Layered(Merged);

impl Layered {
    /// Merges `sources` over `layout`'s defaults.
    pub fn load(layout: &Layout, sources: &Sources<'_>) -> Result<Layered, ConfigError> {
        Merged::from_sources(layout, sources).map(Layered)
    }

    /// The merged table as `T`; unknown keys (with `deny_unknown_fields`) and wrongly typed
    /// values fail naming the key and where its value came from.
    pub fn deserialize<T: DeserializeOwned>(&self) -> Result<T, ConfigError> {
        self.0.deserialize()
    }

    /// An error about `key`, naming where its value came from.
    pub fn err(&self, key: &str, message: impl Into<String>) -> ConfigError {
        self.0.err(key, message)
    }
}

impl Merged {
    /// Every layer merged over the embedded defaults, in order.
    pub(super) fn from_sources(
        layout: &Layout,
        sources: &Sources<'_>,
    ) -> Result<Merged, ConfigError> {
        let table: toml::Table = layout
            .defaults
            .parse()
            .expect("embedded defaults are valid TOML");
        let mut merged = Merged {
            table,
            origins: BTreeMap::new(),
        };

        if let Some(path) = sources.file {
            let shown = path.display().to_string();
            let text = std::fs::read_to_string(path).map_err(|e| {
                ConfigError::new(format!("--config {shown}"), format!("cannot read: {e}"))
            })?;
            let file: toml::Table = text.parse().map_err(|e: toml::de::Error| {
                ConfigError::new(
                    shown.clone(),
                    format!("not valid TOML: {}", one_line(&e.to_string())),
                )
            })?;
            merge(&mut merged.table, file);
        }

        let mut vars = sources.env.vars();
        vars.sort();
        for (var, value) in vars {
            if !var.starts_with(layout.env_prefix) || layout.env_not_keys.contains(&var.as_str()) {
                continue;
            }
            let key = env_key(layout, &var).ok_or_else(|| {
                ConfigError::new(
                    var.clone(),
                    format!(
                        "unknown environment variable (expected {}<SECTION>_<KEY> with a section of {})",
                        layout.env_prefix,
                        layout.sections.join(", ")
                    ),
                )
            })?;
            merged.set(&key, text_value(&value), var)?;
        }

        for o in &sources.overrides {
            merged.set(&o.key, text_value(&o.value), o.origin.clone())?;
        }
        Ok(merged)
    }

    /// The merged table deserialized; an error names the dotted key at fault.
    pub(super) fn raw(&self) -> Result<RawConfig, ConfigError> {
        self.deserialize()
    }

    fn deserialize<T: DeserializeOwned>(&self) -> Result<T, ConfigError> {
        let m = self;
        let de = toml::Value::Table(m.table.clone());
        serde_path_to_error::deserialize::<_, T>(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner().to_string();
            let inner = one_line(&inner);
            // serde reports an unknown key at its section's path; name the key itself.
            if let Some(rest) = inner.strip_prefix("unknown field `") {
                let (field, expected) = rest.split_once('`').unwrap_or((rest, ""));
                let key = join_key(&path, field);
                let expected = expected.split(" in `").next().unwrap_or(expected);
                return m.err(
                    &key,
                    format!(
                        "unknown key{}",
                        expected.replace(", expected", "; expected")
                    ),
                );
            }
            if let Some(field) = inner.strip_prefix("missing field `") {
                let field = field.trim_end_matches('`');
                return m.err(&join_key(&path, field), "required value missing");
            }
            m.err(&path, inner)
        })
    }
}

/// Text from the environment or a flag as a TOML value: an array when written as one, else text
/// (each key's deserializer parses text into its own type).
fn text_value(s: &str) -> toml::Value {
    let t = s.trim();
    if t.starts_with('[')
        && let Ok(table) = format!("v = {t}").parse::<toml::Table>()
        && let Some(v) = table.get("v")
    {
        return v.clone();
    }
    toml::Value::String(s.to_string())
}

/// The dotted key of `field` under `path`, as serde_path_to_error reports them (the path may
/// already end with the field).
fn join_key(path: &str, field: &str) -> String {
    if path == "." || path.is_empty() {
        field.to_string()
    } else if path == field || path.ends_with(&format!(".{field}")) {
        path.to_string()
    } else {
        format!("{path}.{field}")
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_keys_map_to_sections() {
        let env_key = |v| env_key(&SIDECAR, v);
        assert_eq!(
            env_key("ETCD_WARDEN_SNAPSHOT_DELTA_PERIOD").as_deref(),
            Some("snapshot.delta_period")
        );
        assert_eq!(env_key("ETCD_WARDEN_OWNER_ID").as_deref(), Some("owner.id"));
        assert_eq!(
            env_key("ETCD_WARDEN_STORE_URL").as_deref(),
            Some("store.url")
        );
        assert_eq!(env_key("ETCD_WARDEN_STORE"), None);
        assert_eq!(
            env_key("ETCD_WARDEN_STORE_SECONDARY_URL").as_deref(),
            Some("store.secondary.url")
        );
        assert_eq!(
            env_var_for("store.secondary.max_lag"),
            "ETCD_WARDEN_STORE_SECONDARY_MAX_LAG"
        );
        assert_eq!(env_key("ETCD_WARDEN_NOPE_X"), None);
        assert_eq!(
            env_var_for("snapshot.delta_period"),
            "ETCD_WARDEN_SNAPSHOT_DELTA_PERIOD"
        );
    }

    #[test]
    fn text_values_become_arrays_only_when_written_as_one() {
        assert_eq!(
            text_value("[\"a\", \"b\"]"),
            toml::Value::Array(vec!["a".into(), "b".into()])
        );
        assert_eq!(text_value("30s"), toml::Value::String("30s".into()));
        assert_eq!(text_value("[broken"), toml::Value::String("[broken".into()));
    }
}
