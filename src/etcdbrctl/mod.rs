//! `etcdbrctl`'s command line, translated into etcd-warden's configuration, so etcd-druid can run
//! this binary in place of gardener's etcd-backup-restore (its image's ENTRYPOINT `/etcdbrctl`,
//! druid passing only `args`).
//!
//! The binary takes this path when it is invoked under the name `etcdbrctl` (the Containerfile
//! installs that link). The first argument is etcdbrctl's subcommand; every flag after it is read
//! as spf13/pflag reads it (`--name=value`, `--name value`, `-p 8080`, `-p8080`, a bare boolean
//! `--flag` meaning true, `--` ending the flags) and looked up in [`flags::FLAGS`], one row per
//! flag etcd-backup-restore defines: the row either sets an etcd-warden configuration key (the
//! result is a list of [`Override`]s, the same layer `etcd-warden`'s own flags feed, so
//! validation and its messages are shared), or says why etcd-warden has no use for the flag
//! ([`Translation::ignored`], logged at start and tabled in docs/etcd-druid.md). A flag the
//! subcommand does not define, a value that does not parse, or a positional argument is a
//! [`UsageError`] naming it (exit 64), never a silent default.
//!
//! The store flags (`--storage-provider`, `--store-container`, `--store-prefix`,
//! `--store-endpoint-override`, their `source-` twins for `copy`, their `secondary-` twins for
//! `server`) and the credential files druid mounts are read by [`store`] into the `[store]` /
//! `[source_store]` / `[store.secondary]` keys.

pub mod flags;
pub mod store;

use std::time::Duration;

use crate::config::Override;

/// etcdbrctl's subcommands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subcommand {
    /// `server`: etcd-warden's `serve`, with the `[druid]` section (initialization endpoints,
    /// `/config`, Leases).
    Server,
    /// `snapshot`: snapshots on the schedule without etcd-backup-restore's HTTP server; `serve`
    /// with its API on loopback.
    Snapshot,
    /// `restore`: `etcd-warden restore`.
    Restore,
    /// `compact`: `etcd-warden compact`, working under `--data-dir`.
    Compact,
    /// `copy`: `etcd-warden copy`.
    Copy,
    /// `initialize`: validate the data directory and restore it when needed, then exit.
    Initialize,
}

impl Subcommand {
    /// The subcommand named `name`, as etcdbrctl spells it.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "server" => Self::Server,
            "snapshot" => Self::Snapshot,
            "restore" => Self::Restore,
            "compact" => Self::Compact,
            "copy" => Self::Copy,
            "initialize" => Self::Initialize,
            _ => return None,
        })
    }

    /// etcdbrctl's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Server => "server",
            Self::Snapshot => "snapshot",
            Self::Restore => "restore",
            Self::Compact => "compact",
            Self::Copy => "copy",
            Self::Initialize => "initialize",
        }
    }

    /// The bit of this subcommand in [`flags::Flag::commands`].
    pub(crate) fn bit(self) -> u8 {
        match self {
            Self::Server => flags::SERVER,
            Self::Snapshot => flags::SNAPSHOT,
            Self::Restore => flags::RESTORE,
            Self::Compact => flags::COMPACT,
            Self::Copy => flags::COPY,
            Self::Initialize => flags::INITIALIZE,
        }
    }
}

/// A command line etcdbrctl would refuse, or one whose meaning etcd-warden cannot honour.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("etcdbrctl: {0}")]
pub struct UsageError(pub String);

/// The flags of one command line, by name: every value given, in order.
pub type Given = std::collections::BTreeMap<&'static str, Vec<String>>;

/// A flag accepted but without effect, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ignored {
    /// `--flag`.
    pub flag: String,
    /// Why etcd-warden needs it not.
    pub reason: &'static str,
}

/// What an etcdbrctl command line means to etcd-warden.
#[derive(Debug, Clone)]
pub struct Translation {
    pub command: Subcommand,
    /// Configuration keys set by the flags, the store and the environment druid provides.
    pub overrides: Vec<Override>,
    /// Flags given but without effect.
    pub ignored: Vec<Ignored>,
}

impl Translation {
    /// The value `key` was set to, last one winning (for tests and the start-up log).
    pub fn value(&self, key: &str) -> Option<&str> {
        self.overrides
            .iter()
            .rev()
            .find(|o| o.key == key)
            .map(|o| o.value.as_str())
    }
}

/// Where the translation reads the process's environment (the variables druid sets:
/// `POD_NAME`, `POD_NAMESPACE`, `STORAGE_CONTAINER`, the provider credential paths, `HOME`).
pub trait Environment {
    fn var(&self, name: &str) -> Option<String>;
}

/// The real environment.
pub struct ProcessEnvironment;

impl Environment for ProcessEnvironment {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

impl<F: Fn(&str) -> Option<String>> Environment for F {
    fn var(&self, name: &str) -> Option<String> {
        self(name)
    }
}

/// Translates `args` (after the program name: the subcommand, then its flags).
pub fn translate(args: &[String], env: &dyn Environment) -> Result<Translation, UsageError> {
    let Some(first) = args.first() else {
        return Err(UsageError(
            "a subcommand is required: server, snapshot, restore, compact, copy or initialize"
                .into(),
        ));
    };
    let command = Subcommand::parse(first).ok_or_else(|| {
        UsageError(format!(
            "unknown command {first:?}: expected server, snapshot, restore, compact, copy or \
             initialize"
        ))
    })?;
    let given = flags::parse(command, &args[1..])?;
    flags::translate(command, &given, env)
}

/// A Go duration (`time.ParseDuration`: `5m0s`, `1h30m`, `1.5h`, `300ms`, `-1s`, `0`), as the
/// flag gave it, so nothing is rounded: etcd-warden's keys take it in milliseconds (or
/// microseconds below one).
pub fn go_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("{text:?} is not a duration (e.g. 30s, 5m0s, 1h30m)");
    let s = text.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let s = s.strip_prefix('+').unwrap_or(s);
    if s.starts_with('-') {
        return Err(format!("{text:?} is negative"));
    }
    if s.is_empty() {
        return Err(bad());
    }
    let mut total = 0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        if num_len == 0 {
            return Err(bad());
        }
        let value: f64 = rest[..num_len].parse().map_err(|_| bad())?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let nanos = match &rest[..unit_len] {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            _ => return Err(bad()),
        };
        total += value * nanos;
        rest = &rest[unit_len..];
    }
    Ok(Duration::from_nanos(total.round() as u64))
}

/// `d` as an etcd-warden duration value.
pub fn duration_value(d: Duration) -> String {
    if d.subsec_nanos().is_multiple_of(1_000_000) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}us", d.as_micros())
    }
}

/// A Go boolean (`strconv.ParseBool`).
pub fn go_bool(text: &str) -> Option<bool> {
    match text {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_read_as_go_reads_them() {
        for (text, ms) in [
            ("5m0s", 300_000),
            ("1h0m0s", 3_600_000),
            ("20s", 20_000),
            ("1.5h", 5_400_000),
            ("300ms", 300),
            ("0", 0),
            ("0s", 0),
            ("2h45m", 9_900_000),
            ("1m30.5s", 90_500),
        ] {
            assert_eq!(go_duration(text), Ok(Duration::from_millis(ms)), "{text}");
        }
        for bad in ["", "5", "5x", "m", "1h-", "-1s", "1 h"] {
            assert!(go_duration(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(duration_value(Duration::from_millis(1500)), "1500ms");
        assert_eq!(duration_value(Duration::from_micros(1500)), "1500us");
    }

    #[test]
    fn go_booleans_are_strconv_parse_bool() {
        for t in ["1", "t", "T", "TRUE", "true", "True"] {
            assert_eq!(go_bool(t), Some(true));
        }
        for f in ["0", "f", "F", "FALSE", "false", "False"] {
            assert_eq!(go_bool(f), Some(false));
        }
        for bad in ["yes", "tRUE", "", "on"] {
            assert_eq!(go_bool(bad), None);
        }
    }

    #[test]
    fn the_subcommand_comes_first_and_must_be_known() {
        let env = |_: &str| None;
        assert!(translate(&[], &env).unwrap_err().0.contains("subcommand"));
        let e = translate(&["serve".into()], &env).unwrap_err();
        assert!(e.0.contains("\"serve\""), "{e}");
    }
}
