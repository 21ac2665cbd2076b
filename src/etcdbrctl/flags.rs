//! etcdbrctl's flags: the table of every flag etcd-backup-restore defines (gardener/
//! etcd-backup-restore `cmd/options.go` and the option types it registers, at `debd95bd`), which
//! subcommands define it, and what it becomes in etcd-warden; the pflag-style parser; and the
//! translation of the parsed flags into configuration overrides.

use super::{Environment, Given, Ignored, Subcommand, Translation, UsageError};
use super::{duration_value, go_bool, go_duration};
use crate::config::Override;

pub(crate) const SERVER: u8 = 1;
pub(crate) const SNAPSHOT: u8 = 1 << 1;
pub(crate) const RESTORE: u8 = 1 << 2;
pub(crate) const COMPACT: u8 = 1 << 3;
pub(crate) const COPY: u8 = 1 << 4;
pub(crate) const INITIALIZE: u8 = 1 << 5;
const ALL: u8 = SERVER | SNAPSHOT | RESTORE | COMPACT | COPY | INITIALIZE;
/// The subcommands that talk to a running etcd.
const ETCD: u8 = SERVER | SNAPSHOT | INITIALIZE;
/// The subcommands that take snapshots on a schedule.
const SNAPSHOTTER: u8 = SERVER | SNAPSHOT;
/// The subcommands that restore a data directory.
const RESTORATION: u8 = SERVER | RESTORE | INITIALIZE | COMPACT;

/// How a flag takes its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// `--flag`, `--flag=true|false`: never the next argument.
    Bool,
    /// One value; given again, the last wins.
    One,
    /// pflag's StringSlice: split on commas, and repeatable (the values add up).
    List,
}

/// What a flag becomes.
#[derive(Debug, Clone, Copy)]
pub enum Effect {
    /// Sets this configuration key, the value converted as [`Convert`] says.
    Key(&'static str, Convert),
    /// Read with the other store flags by [`super::store`].
    Store,
    /// Read after every flag is known ([`translate`] names it).
    Later,
    /// Accepted without effect, for this reason.
    Ignored(&'static str),
    /// Refused: etcd-warden cannot do what the flag asks, and ignoring it would lose data or
    /// safety.
    Refused(&'static str),
}

/// How a flag's text becomes a key's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Convert {
    /// As given.
    Text,
    /// A Go duration.
    Duration,
    /// A Go boolean.
    Bool,
    /// A non-negative integer.
    Count,
    /// A comma-joined list.
    List,
}

/// One flag of etcdbrctl.
#[derive(Debug, Clone, Copy)]
pub struct Flag {
    pub name: &'static str,
    pub short: Option<char>,
    pub shape: Shape,
    /// The subcommands defining it ([`SERVER`] | ...).
    pub commands: u8,
    pub effect: Effect,
}

const fn flag(name: &'static str, shape: Shape, commands: u8, effect: Effect) -> Flag {
    Flag {
        name,
        short: None,
        shape,
        commands,
        effect,
    }
}

const fn short(f: Flag, c: char) -> Flag {
    Flag {
        short: Some(c),
        ..f
    }
}

use Convert as C;
use Effect::{Ignored as Ign, Key, Later, Refused, Store};
use Shape::{Bool, List, One};

const NO_EMBEDDED_ETCD: &str = "etcd-warden writes the deltas into the restored database itself \
    and runs no embedded etcd that serves it; the member's own settings come from etcd's \
    configuration";
const STREAMED: &str = "uploads and downloads are streamed; nothing is staged on disk";
const ALWAYS_VERIFIED: &str = "etcd-warden always verifies what it restores";

/// Every flag of etcdbrctl (`server`, `snapshot`, `restore`, `compact`, `copy`, `initialize`).
pub const FLAGS: &[Flag] = &[
    // The HTTP server (server).
    short(flag("server-port", One, SERVER, Later), 'p'),
    flag(
        "server-cert",
        One,
        SERVER,
        Key("server.tls_cert_file", C::Text),
    ),
    flag(
        "server-key",
        One,
        SERVER,
        Key("server.tls_key_file", C::Text),
    ),
    flag(
        "enable-profiling",
        Bool,
        SERVER,
        Ign("etcd-warden serves no pprof; see /metrics and /status"),
    ),
    // etcd connection.
    short(
        flag(
            "endpoints",
            List,
            ETCD | COMPACT,
            Key("etcd.endpoints", C::List),
        ),
        'e',
    ),
    flag(
        "service-endpoints",
        List,
        ETCD,
        Key("restore.cluster_endpoints", C::List),
    ),
    flag("cacert", One, ETCD, Key("etcd.ca_file", C::Text)),
    flag("cert", One, ETCD, Key("etcd.cert_file", C::Text)),
    flag("key", One, ETCD, Key("etcd.key_file", C::Text)),
    flag(
        "insecure-transport",
        Bool,
        ETCD,
        Ign("the scheme of --endpoints decides: https:// uses TLS"),
    ),
    flag(
        "insecure-skip-tls-verify",
        Bool,
        ETCD,
        Ign(
            "etcd-warden always verifies etcd's certificate against --cacert (druid sets this only without client TLS)",
        ),
    ),
    flag(
        "etcd-connection-timeout",
        One,
        ETCD,
        Key("etcd.request_timeout", C::Duration),
    ),
    flag("etcd-username", One, ETCD, Key("etcd.username", C::Text)),
    flag("etcd-password", One, ETCD, Key("etcd.password", C::Text)),
    flag(
        "etcd-connection-timeout-leader-election",
        One,
        SERVER,
        Ign("leadership is read within etcd.request_timeout (--etcd-connection-timeout)"),
    ),
    flag(
        "reelection-period",
        One,
        SERVER,
        Key("snapshot.leader_check_interval", C::Duration),
    ),
    flag(
        "use-etcd-wrapper",
        Bool,
        SERVER,
        Ign(
            "etcd-warden restores the member with its own name and peer URLs, so it never restarts etcd through the wrapper to repair them",
        ),
    ),
    // Leases.
    flag(
        "enable-member-lease-renewal",
        Bool,
        SERVER,
        Key("druid.member_lease", C::Bool),
    ),
    flag(
        "k8s-heartbeat-duration",
        One,
        SERVER,
        Key("druid.heartbeat", C::Duration),
    ),
    flag(
        "enable-snapshot-lease-renewal",
        Bool,
        SERVER | COMPACT,
        Key("druid.snapshot_leases", C::Bool),
    ),
    flag(
        "full-snapshot-lease-name",
        One,
        SERVER | COMPACT,
        Key("druid.full_snapshot_lease", C::Text),
    ),
    flag(
        "delta-snapshot-lease-name",
        One,
        SERVER | COMPACT,
        Key("druid.delta_snapshot_lease", C::Text),
    ),
    // Snapshots.
    short(
        flag(
            "schedule",
            One,
            SNAPSHOTTER,
            Key("snapshot.schedule", C::Text),
        ),
        's',
    ),
    flag("delta-snapshot-period", One, SNAPSHOTTER, Later),
    flag(
        "delta-snapshot-memory-limit",
        One,
        SNAPSHOTTER,
        Key("snapshot.delta_memory_limit", C::Count),
    ),
    flag(
        "delta-snapshot-retention-period",
        One,
        SNAPSHOTTER,
        Key("snapshot.delta_retention", C::Duration),
    ),
    flag(
        "garbage-collection-policy",
        One,
        SNAPSHOTTER,
        Key("snapshot.gc_policy", C::Text),
    ),
    short(
        flag(
            "max-backups",
            One,
            SNAPSHOTTER,
            Key("snapshot.max_backups", C::Count),
        ),
        'm',
    ),
    flag(
        "garbage-collection-period",
        One,
        SNAPSHOTTER,
        Key("snapshot.gc_period", C::Duration),
    ),
    flag("compress-snapshots", Bool, SNAPSHOTTER | COMPACT, Later),
    flag("compression-policy", One, SNAPSHOTTER | COMPACT, Later),
    flag(
        "etcd-snapshot-timeout",
        One,
        SNAPSHOTTER | COMPACT,
        Key("snapshot.timeout", C::Duration),
    ),
    flag(
        "defragmentation-schedule",
        One,
        SNAPSHOTTER,
        Key("defrag.schedule", C::Text),
    ),
    flag(
        "etcd-defrag-timeout",
        One,
        SNAPSHOTTER | COMPACT,
        Key("defrag.timeout", C::Duration),
    ),
    flag(
        "backoff-multiplier",
        One,
        SNAPSHOTTER,
        Ign("the snapshot actor's retries back off on their own schedule"),
    ),
    flag(
        "backoff-attempt-limit",
        One,
        SNAPSHOTTER,
        Ign("the snapshot actor's retries back off on their own schedule"),
    ),
    flag(
        "backoff-threshold-time",
        One,
        SNAPSHOTTER,
        Ign("the snapshot actor's retries back off on their own schedule"),
    ),
    // Restoration.
    short(
        flag(
            "data-dir",
            One,
            RESTORATION,
            Key("restore.data_dir", C::Text),
        ),
        'd',
    ),
    flag(
        "restoration-temp-snapshots-dir",
        One,
        RESTORATION,
        Ign(STREAMED),
    ),
    flag(
        "initial-cluster",
        One,
        RESTORATION,
        Key("restore.initial_cluster", C::Text),
    ),
    flag(
        "initial-cluster-token",
        One,
        RESTORATION,
        Key("restore.initial_cluster_token", C::Text),
    ),
    flag(
        "initial-advertise-peer-urls",
        List,
        RESTORATION,
        Key("restore.initial_advertise_peer_urls", C::List),
    ),
    flag("name", One, RESTORATION, Key("restore.name", C::Text)),
    flag("skip-hash-check", Bool, RESTORATION, Ign(ALWAYS_VERIFIED)),
    flag(
        "max-fetchers",
        One,
        RESTORATION,
        Key("restore.parallel_fetch", C::Count),
    ),
    flag(
        "max-call-send-message-size",
        One,
        RESTORATION,
        Ign(NO_EMBEDDED_ETCD),
    ),
    flag("max-request-bytes", One, RESTORATION, Ign(NO_EMBEDDED_ETCD)),
    flag("max-txn-ops", One, RESTORATION, Ign(NO_EMBEDDED_ETCD)),
    flag(
        "embedded-etcd-quota-bytes",
        One,
        RESTORATION,
        Ign(NO_EMBEDDED_ETCD),
    ),
    flag(
        "auto-compaction-mode",
        One,
        RESTORATION,
        Ign(NO_EMBEDDED_ETCD),
    ),
    flag(
        "auto-compaction-retention",
        One,
        RESTORATION,
        Ign(NO_EMBEDDED_ETCD),
    ),
    // The store.
    flag("storage-provider", One, ALL, Store),
    flag("store-container", One, ALL, Store),
    flag("store-prefix", One, ALL, Store),
    flag("store-endpoint-override", One, ALL, Store),
    flag(
        "max-parallel-chunk-uploads",
        One,
        ALL,
        Ign("parts are uploaded as etcd-warden's store writer schedules them"),
    ),
    flag(
        "min-chunk-size",
        One,
        ALL,
        Ign("parts are uploaded as etcd-warden's store writer schedules them"),
    ),
    flag("snapstore-temp-directory", One, ALL, Ign(STREAMED)),
    // The secondary store (`server` alone defines these): read by [`super::store`] into
    // `[store.secondary]`, and only with `--secondary-backup-sync-enabled=true`.
    flag("secondary-storage-provider", One, SERVER, Store),
    flag("secondary-store-container", One, SERVER, Store),
    flag("secondary-store-endpoint-override", One, SERVER, Store),
    flag("secondary-store-prefix", One, SERVER, Store),
    flag("secondary-max-parallel-chunk-uploads", One, SERVER, Store),
    flag("secondary-min-chunk-size", One, SERVER, Store),
    flag("secondary-snapstore-temp-directory", One, SERVER, Store),
    flag("secondary-backup-sync-enabled", Bool, SERVER, Store),
    flag("secondary-backup-sync-period", One, SERVER, Store),
    // compact.
    flag(
        "defragment",
        Bool,
        COMPACT,
        Ign("etcd-warden's compaction always defragments"),
    ),
    flag(
        "metrics-scrape-wait-duration",
        One,
        COMPACT,
        Ign("the compaction Job's outcome is in its exit status and the full snapshot Lease"),
    ),
    // copy: the source store and the selection.
    flag("source-storage-provider", One, COPY, Store),
    flag("source-store-container", One, COPY, Store),
    flag("source-store-prefix", One, COPY, Store),
    flag("source-store-endpoint-override", One, COPY, Store),
    flag(
        "source-max-parallel-chunk-uploads",
        One,
        COPY,
        Ign("parts are uploaded as etcd-warden's store writer schedules them"),
    ),
    flag(
        "source-min-chunk-size",
        One,
        COPY,
        Ign("parts are uploaded as etcd-warden's store writer schedules them"),
    ),
    flag("source-snapstore-temp-directory", One, COPY, Ign(STREAMED)),
    flag("max-backups-to-copy", One, COPY, Later),
    flag("max-backup-age", One, COPY, Later),
    flag(
        "max-parallel-copy-operations",
        One,
        COPY,
        Key("copy.parallel", C::Count),
    ),
    flag(
        "wait-for-final-snapshot",
        Bool,
        COPY,
        Key("copy.wait_for_final", C::Bool),
    ),
    flag("wait-for-final-snapshot-timeout", One, COPY, Later),
    // initialize.
    flag("validation-mode", One, INITIALIZE, Later),
    // Everywhere.
    flag("log-level", One, ALL, Later),
    flag(
        "config-file",
        One,
        SNAPSHOTTER,
        Refused(
            "etcd-backup-restore's YAML configuration is not read; pass its flags, or etcd-warden's own TOML file in ETCD_WARDEN_CONFIG",
        ),
    ),
];

fn find(name: &str) -> Option<&'static Flag> {
    FLAGS.iter().find(|f| f.name == name)
}

fn find_short(c: char) -> Option<&'static Flag> {
    FLAGS.iter().find(|f| f.short == Some(c))
}

/// Reads `args` as pflag does for `command`: every flag must be one it defines.
pub fn parse(command: Subcommand, args: &[String]) -> Result<Given, UsageError> {
    let mut given = Given::new();
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        i += 1;
        if arg == "--" {
            if let Some(extra) = args.get(i) {
                return Err(UsageError(format!(
                    "{} takes no arguments, got {extra:?}",
                    command.name()
                )));
            }
            break;
        }
        let (f, inline) = if let Some(long) = arg.strip_prefix("--") {
            let (name, value) = match long.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (long, None),
            };
            let f = find(name).ok_or_else(|| unknown(command, &format!("--{name}")))?;
            (f, value)
        } else if let Some(shorts) = arg.strip_prefix('-').filter(|s| !s.is_empty()) {
            let mut chars = shorts.chars();
            let c = chars.next().expect("not empty");
            let f = find_short(c).ok_or_else(|| unknown(command, &format!("-{c}")))?;
            let rest = chars.as_str();
            let value =
                (!rest.is_empty()).then(|| rest.strip_prefix('=').unwrap_or(rest).to_string());
            (f, value)
        } else {
            return Err(UsageError(format!(
                "{} takes no arguments, got {arg:?}",
                command.name()
            )));
        };
        if f.commands & command.bit() == 0 {
            return Err(unknown(command, &format!("--{}", f.name)));
        }
        let value = match (f.shape, inline) {
            (_, Some(v)) => v,
            (Shape::Bool, None) => "true".into(),
            (_, None) => {
                let v = args
                    .get(i)
                    .ok_or_else(|| UsageError(format!("flag needs an argument: --{}", f.name)))?;
                i += 1;
                v.clone()
            }
        };
        if f.shape == Shape::Bool && go_bool(&value).is_none() {
            return Err(UsageError(format!(
                "invalid argument {value:?} for --{}: not a boolean (true or false)",
                f.name
            )));
        }
        given.entry(f.name).or_default().push(value);
    }
    Ok(given)
}

fn unknown(command: Subcommand, flag: &str) -> UsageError {
    UsageError(format!(
        "unknown flag: {flag} (etcdbrctl {} defines no such flag)",
        command.name()
    ))
}

/// The value of a one-value flag: the last given.
fn last<'a>(given: &'a Given, name: &str) -> Option<&'a str> {
    given.get(name).and_then(|v| v.last()).map(String::as_str)
}

/// Every value of a list flag, split on commas, empty items dropped.
fn items(given: &Given, name: &str) -> Vec<String> {
    given
        .get(name)
        .into_iter()
        .flatten()
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

fn invalid(flag: &str, value: &str, why: impl std::fmt::Display) -> UsageError {
    UsageError(format!("invalid argument {value:?} for --{flag}: {why}"))
}

fn count(flag: &str, value: &str) -> Result<u64, UsageError> {
    value
        .trim()
        .parse::<u64>()
        .map_err(|_| invalid(flag, value, "not a non-negative integer"))
}

fn signed(flag: &str, value: &str) -> Result<i64, UsageError> {
    value
        .trim()
        .parse::<i64>()
        .map_err(|_| invalid(flag, value, "not an integer"))
}

fn duration(flag: &str, value: &str) -> Result<std::time::Duration, UsageError> {
    go_duration(value).map_err(|e| invalid(flag, value, e))
}

/// The configuration `given` means for `command`.
pub fn translate(
    command: Subcommand,
    given: &Given,
    env: &dyn Environment,
) -> Result<Translation, UsageError> {
    let mut t = Translation {
        command,
        overrides: Vec::new(),
        ignored: Vec::new(),
    };
    let set = |t: &mut Translation, key: &str, value: String, flag: &str| {
        t.overrides
            .push(Override::flag(key, value, &format!("etcdbrctl --{flag}")));
    };
    for (&name, values) in given {
        let f = find(name).expect("parsed flags are in the table");
        let value = values.last().expect("a given flag has a value").as_str();
        match f.effect {
            Effect::Key(key, convert) => {
                let v = match convert {
                    Convert::Text => value.to_string(),
                    Convert::List => items(given, name).join(","),
                    Convert::Duration => duration_value(duration(name, value)?),
                    Convert::Bool => go_bool(value).expect("checked by parse").to_string(),
                    Convert::Count => count(name, value)?.to_string(),
                };
                set(&mut t, key, v, name);
            }
            Effect::Ignored(reason) => t.ignored.push(Ignored {
                flag: format!("--{name}"),
                reason,
            }),
            Effect::Refused(reason) => {
                return Err(UsageError(format!("--{name} is not supported: {reason}")));
            }
            Effect::Store | Effect::Later => {}
        }
    }
    if let Some(port) = last(given, "server-port") {
        let port: u16 = port
            .trim()
            .parse()
            .map_err(|_| invalid("server-port", port, "not a port number (1-65535)"))?;
        // etcd-backup-restore listens on every interface: druid's Service and the wrapper
        // reach it by the pod's address and by `<etcd>-local` (127.0.0.1).
        set(
            &mut t,
            "server.listen",
            format!("0.0.0.0:{port}"),
            "server-port",
        );
    }
    if let Some(p) = last(given, "delta-snapshot-period") {
        // Below a second disables deltas in etcd-backup-restore; "0s" does here.
        let d = duration("delta-snapshot-period", p)?;
        let v = if d < std::time::Duration::from_secs(1) {
            "0s".to_string()
        } else {
            duration_value(d)
        };
        set(&mut t, "snapshot.delta_period", v, "delta-snapshot-period");
    }
    compression(&mut t, given)?;
    copy_selection(&mut t, given)?;
    if let Some(mode) = last(given, "validation-mode") {
        if !matches!(mode, "full" | "sanity") {
            return Err(invalid("validation-mode", mode, "expected full or sanity"));
        }
        set(&mut t, "restore.validation", mode.into(), "validation-mode");
    }
    if let Some(level) = last(given, "log-level") {
        set(&mut t, "log.level", log_level(level)?.into(), "log-level");
    }
    super::store::translate(&mut t, given, env)?;
    druid(&mut t, env);
    Ok(t)
}

/// `--compress-snapshots` and `--compression-policy`: `false` writes uncompressed whatever the
/// policy says, as etcd-backup-restore does.
fn compression(t: &mut Translation, given: &Given) -> Result<(), UsageError> {
    let compress = last(given, "compress-snapshots").map(|v| go_bool(v).expect("checked"));
    let policy = last(given, "compression-policy");
    let value = match (compress, policy) {
        (Some(false), _) => "none",
        (_, Some("gzip")) => "gzip",
        (_, Some("zlib")) => "zlib",
        (_, Some("lzw")) => {
            return Err(UsageError(
                "--compression-policy=lzw is not supported for new snapshots (etcd-warden reads \
                 .Z snapshots but writes gzip or zlib); use gzip or zlib"
                    .into(),
            ));
        }
        (_, Some(other)) => {
            return Err(invalid(
                "compression-policy",
                other,
                "expected gzip, zlib or lzw",
            ));
        }
        // etcd-backup-restore's default: gzip.
        (Some(true), None) | (None, None) if t.command == Subcommand::Server => "gzip",
        (Some(true), None) | (None, None) => return Ok(()),
    };
    t.overrides.push(Override::flag(
        "snapshot.compression",
        value,
        "etcdbrctl --compress-snapshots/--compression-policy",
    ));
    Ok(())
}

/// `copy`'s selection: etcd-backup-restore's "all" (-1) and its timeout 0 ("wait for ever").
fn copy_selection(t: &mut Translation, given: &Given) -> Result<(), UsageError> {
    let mut set = |key: &str, value: String, flag: &str| {
        t.overrides
            .push(Override::flag(key, value, &format!("etcdbrctl --{flag}")));
    };
    if let Some(v) = last(given, "max-backups-to-copy") {
        let n = signed("max-backups-to-copy", v)?;
        if n < -1 {
            return Err(invalid("max-backups-to-copy", v, "-1 (all) or a count"));
        }
        set(
            "copy.max_backups",
            n.max(0).to_string(),
            "max-backups-to-copy",
        );
    }
    if let Some(v) = last(given, "max-backup-age") {
        let days = signed("max-backup-age", v)?;
        if days < -1 {
            return Err(invalid("max-backup-age", v, "-1 (any age) or days"));
        }
        let age = if days < 0 {
            String::new()
        } else {
            format!("{days}d")
        };
        set("copy.max_age", age, "max-backup-age");
    }
    if let Some(v) = last(given, "wait-for-final-snapshot-timeout") {
        let d = duration("wait-for-final-snapshot-timeout", v)?;
        let timeout = if d.is_zero() {
            // No bound: the longest duration a key takes.
            "100y".to_string()
        } else {
            duration_value(d)
        };
        set(
            "copy.final_timeout",
            timeout,
            "wait-for-final-snapshot-timeout",
        );
    } else if t.command == Subcommand::Copy {
        // etcd-backup-restore's default, 0: wait as long as it takes.
        set(
            "copy.final_timeout",
            "100y".into(),
            "wait-for-final-snapshot-timeout",
        );
    }
    // etcd-backup-restore's copy waits for "the newest snapshot is a final full one", which
    // under etcd-druid is a final druid asked for (`isFinal` before hibernation or a migration):
    // a hand-off's final or druid's requested final ends etcdbrctl's wait.
    if t.command == Subcommand::Copy
        && last(given, "wait-for-final-snapshot").is_some_and(|v| go_bool(v) == Some(true))
    {
        set("copy.druid_final", "true".into(), "wait-for-final-snapshot");
    }
    Ok(())
}

/// logrus's numeric levels (etcd-backup-restore's `--log-level`, default 4 = info).
fn log_level(text: &str) -> Result<&'static str, UsageError> {
    Ok(match text.trim() {
        "0" | "1" | "2" => "error",
        "3" => "warn",
        "4" => "info",
        "5" => "debug",
        "6" => "trace",
        _ => {
            return Err(invalid(
                "log-level",
                text,
                "expected 0 (panic) to 6 (trace)",
            ));
        }
    })
}

/// What `server` (and `compact`, for its Lease) reads from the pod as etcd-backup-restore
/// does: etcd's configuration file (`$ETCD_CONF`, else where druid mounts it), the pod's name
/// and namespace.
fn druid(t: &mut Translation, env: &dyn Environment) {
    if !matches!(t.command, Subcommand::Server | Subcommand::Compact) {
        return;
    }
    let lease_keys = t.overrides.iter().any(|o| o.key.starts_with("druid."));
    if t.command == Subcommand::Compact && !lease_keys {
        return;
    }
    let command = t.command;
    let mut set = |key: &str, value: String, origin: &str| {
        t.overrides.push(Override::flag(key, value, origin));
    };
    for (key, var) in [
        ("druid.pod_name", "POD_NAME"),
        ("druid.pod_namespace", "POD_NAMESPACE"),
    ] {
        if let Some(v) = env.var(var) {
            set(key, v, var);
        }
    }
    if command != Subcommand::Server {
        return;
    }
    let config = env
        .var("ETCD_CONF")
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "/var/etcd/config/etcd.conf.yaml".into());
    set("druid.etcd_config", config, "ETCD_CONF");
    // etcd-backup-restore's snapshot triggers answer anyone who reaches the port; druid sends
    // no token. A final snapshot still needs an authenticated caller. Given a token or a
    // client CA through etcd-warden's own variables, the triggers need them too.
    let authenticated = [
        "ETCD_WARDEN_SERVER_TOKEN",
        "ETCD_WARDEN_SERVER_TOKEN_FILE",
        "ETCD_WARDEN_SERVER_TLS_CLIENT_CA_FILE",
    ]
    .iter()
    .any(|v| env.var(v).is_some_and(|x| !x.is_empty()));
    if !authenticated {
        set(
            "server.unauthenticated_snapshots",
            "true".into(),
            "etcdbrctl server",
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn every_flag_has_one_row_and_every_short_form_one_flag() {
        let mut names: Vec<_> = FLAGS.iter().map(|f| f.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), FLAGS.len(), "a flag is in the table twice");
        let shorts: Vec<_> = FLAGS.iter().filter_map(|f| f.short).collect();
        for c in &shorts {
            assert_eq!(shorts.iter().filter(|x| *x == c).count(), 1, "-{c}");
        }
    }

    #[test]
    fn pflag_forms_are_read_alike() {
        for line in [
            "--server-port=9090",
            "--server-port 9090",
            "-p 9090",
            "-p9090",
            "-p=9090",
            "--server-port=1 --server-port=9090",
        ] {
            let g = parse(Subcommand::Server, &args(line)).unwrap();
            assert_eq!(last(&g, "server-port"), Some("9090"), "{line}");
        }
        let g = parse(
            Subcommand::Server,
            &args("--enable-profiling --use-etcd-wrapper=false"),
        )
        .unwrap();
        assert_eq!(last(&g, "enable-profiling"), Some("true"));
        assert_eq!(last(&g, "use-etcd-wrapper"), Some("false"));
        let g = parse(
            Subcommand::Server,
            &args("-e http://a:2379,http://b:2379 --endpoints http://c:2379"),
        )
        .unwrap();
        assert_eq!(
            items(&g, "endpoints"),
            ["http://a:2379", "http://b:2379", "http://c:2379"]
        );
    }

    #[test]
    fn unknown_flags_arguments_and_bad_values_are_refused_by_name() {
        let cases = [
            (Subcommand::Server, "--no-such-flag=1", "--no-such-flag"),
            (Subcommand::Copy, "--server-port=8080", "--server-port"),
            (Subcommand::Server, "-z", "-z"),
            (Subcommand::Server, "extra", "\"extra\""),
            (Subcommand::Server, "--server-port", "needs an argument"),
            (Subcommand::Server, "--enable-profiling=yes", "\"yes\""),
            (Subcommand::Server, "-- extra", "\"extra\""),
        ];
        for (command, line, named) in cases {
            let e = parse(command, &args(line)).unwrap_err();
            assert!(e.0.contains(named), "{line}: {e}");
        }
        let env = |_: &str| None;
        for (line, named) in [
            ("--server-port=http", "--server-port"),
            ("--delta-snapshot-period=20", "--delta-snapshot-period"),
            ("--max-backups=-1", "--max-backups"),
            ("--compression-policy=lzw", "lzw"),
            ("--compression-policy=zstd", "--compression-policy"),
            (
                "--storage-provider=S3 --store-container=b --secondary-backup-sync-enabled",
                "--secondary-storage-provider",
            ),
            ("--log-level=9", "--log-level"),
        ] {
            let g = parse(Subcommand::Server, &args(line)).unwrap();
            let e = translate(Subcommand::Server, &g, &env).unwrap_err();
            assert!(e.0.contains(named), "{line}: {e}");
        }
    }

    #[test]
    fn values_become_etcd_warden_values() {
        let env = |k: &str| (k == "HOME").then(|| "/home/nonroot".to_string());
        let g = parse(
            Subcommand::Server,
            &args(
                "--storage-provider=Local --delta-snapshot-period=500ms --compress-snapshots=false \
                 --compression-policy=zlib --etcd-connection-timeout=5m0s --log-level=5",
            ),
        )
        .unwrap();
        let t = translate(Subcommand::Server, &g, &env).unwrap();
        assert_eq!(t.value("snapshot.delta_period"), Some("0s"));
        assert_eq!(t.value("snapshot.compression"), Some("none"));
        assert_eq!(t.value("etcd.request_timeout"), Some("300000ms"));
        assert_eq!(t.value("log.level"), Some("debug"));
        let g = parse(
            Subcommand::Copy,
            &args("--storage-provider=Local --max-backups-to-copy=-1 --max-backup-age=3 --wait-for-final-snapshot-timeout=0"),
        )
        .unwrap();
        let t = translate(Subcommand::Copy, &g, &env).unwrap();
        assert_eq!(t.value("copy.max_backups"), Some("0"));
        assert_eq!(t.value("copy.max_age"), Some("3d"));
        assert_eq!(t.value("copy.final_timeout"), Some("100y"));
    }
}
