//! `etcd-warden`: parse flags, load and validate configuration, init telemetry, run a subcommand,
//! map the outcome to an exit status (0 ok, 64 bad configuration, 3 a restore that fell back to an
//! older full snapshot, 1 anything else).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use etcd_warden::config::{Config, ConfigError, Override, ProcessEnv, Purpose, Sources};
use etcd_warden::kubernetes::events::{Job, report_job};
use tokio_util::sync::CancellationToken;

/// Exit status for bad configuration (EX_USAGE).
const EXIT_CONFIG: u8 = 64;
/// Exit status of a restore that fell back past a full snapshot that fails verification: the
/// data directory is in place, but older than the store's latest full snapshot. Not 2, which
/// clap exits with on a usage error.
const EXIT_RESTORED_OLDER: u8 = 3;

/// A command that did its work but must not exit 0: the status it exits with, and why.
#[derive(Debug)]
struct Degraded {
    status: u8,
    message: String,
}

impl std::fmt::Display for Degraded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Degraded {}

#[derive(Parser)]
#[command(
    name = "etcd-warden",
    version,
    about = "Backs up and restores etcd and guards its ownership"
)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Command,
}

#[derive(Args)]
struct Global {
    /// Configuration file (TOML); every key documented in config.example.toml.
    #[arg(long, global = true, env = "ETCD_WARDEN_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// Log level directive (log.level), e.g. `info` or `etcd_warden=debug`.
    #[arg(long, global = true, value_name = "LEVEL")]
    log_level: Option<String>,
    /// Log format (log.format): human or json.
    #[arg(long, global = true, value_name = "FORMAT")]
    log_format: Option<String>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the sidecar: snapshots, readiness, ownership checks and the HTTP API.
    Serve,
    /// Print the effective configuration (every layer applied, secrets redacted) and exit.
    Config,
    /// Take one full snapshot now and print its name.
    Snapshot {
        /// Mark it final (the last snapshot of this etcd before it changes owner). With an
        /// [owner] section, refused unless the owner record names another seed or none.
        #[arg(long)]
        r#final: bool,
    },
    /// Undo a hand-off in the store: remove the fence markers and the hand-off record, mark the
    /// finals reclaimed, so this cluster's sidecars may become Active again after a restart.
    /// With an [owner] section, refused unless the owner record names this seed.
    Reclaim {
        #[command(flatten)]
        store: StoreArg,
    },
    /// List the snapshots in a store, oldest first.
    Ls {
        #[command(flatten)]
        store: StoreArg,
        #[command(flatten)]
        which: WhichStore,
        /// One JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Check every snapshot's name, compression and hash; with --restore, also a restore drill.
    ///
    /// --restore restores the newest chain into a scratch directory, starts etcd on it and
    /// checks its revision, key count and every key, value and revision against what the chain
    /// implies (read a second way), then records the outcome in the store for the sidecars'
    /// metrics (etcd_warden_restore_drill_*). Runnable as a CronJob (deploy/drill-job).
    /// Exit status: 0 all checks passed; 1 a check failed.
    Verify {
        #[command(flatten)]
        store: StoreArg,
        #[command(flatten)]
        which: WhichStore,
        /// Also restore the newest chain and check it in a running etcd (a restore drill).
        #[arg(long)]
        restore: bool,
        /// With --restore: where the scratch directory goes (about twice the database), a new
        /// private one inside it; default restore.work_dir, else data_dir's parent, else the
        /// system's temporary directory.
        #[arg(long, value_name = "DIR", requires = "restore")]
        work_dir: Option<PathBuf>,
        /// With --restore: directory of etcd and etcdutl/etcdctl (restore.etcd_bin).
        #[arg(long, value_name = "DIR", requires = "restore")]
        etcd_bin: Option<String>,
    },
    /// Copy snapshots from a source store to this one, optionally after the source's final one.
    Copy(CopyArgs),
    /// Fold the latest full snapshot and its deltas into one new full snapshot (restored into a
    /// temporary etcd, compacted at its head revision, defragmented), so later restores replay
    /// no long delta chain. Runnable as a Job (deploy/compact-job).
    Compact {
        #[command(flatten)]
        store: StoreArg,
        /// Where the work directory goes (about twice the database), a new private one inside
        /// it; default restore.work_dir, else data_dir's parent, else the system's temporary
        /// directory.
        #[arg(long, value_name = "DIR")]
        work_dir: Option<PathBuf>,
        /// Directory of etcd and etcdutl/etcdctl (restore.etcd_bin); default PATH.
        #[arg(long, value_name = "DIR")]
        etcd_bin: Option<String>,
    },
    /// Build an etcd data directory from the latest full snapshot and every later delta, or from
    /// the state at a point in the past (--to-revision, --to-time).
    ///
    /// Exit status: 0 restored from the latest full snapshot; 3 restored, but from an older
    /// full snapshot because a newer one fails verification (the data directory is in place;
    /// the output names the skipped snapshot and the revisions not restored; --no-fallback
    /// fails instead); 1 failed, nothing moved into place; 64 bad configuration.
    Restore {
        #[command(flatten)]
        store: StoreArg,
        #[command(flatten)]
        which: WhichStore,
        #[command(flatten)]
        restore: RestoreArgs,
    },
    /// Rebuild a one-member cluster from the freshest surviving member after a majority of
    /// the members is lost for good (run where a survivor's data directory is, its etcd
    /// stopped). Refuses unless a majority stays unreachable for --lost-for, this member's
    /// etcd is stopped, the store shows no hand-off and the survivor is not behind the store's
    /// newest snapshot (--force). The original directory is kept aside, never changed.
    ///
    /// Exit status: 0 rebuilt; 1 refused or failed, nothing changed; 64 bad configuration.
    QuorumRestore(QuorumRestoreArgs),
    /// Check the data directory (restore.data_dir) as `serve` with restore.initialize does
    /// before etcd starts, and restore it from the store when it is missing, fails validation
    /// (restore.validation) or is behind the store; a valid directory is kept.
    ///
    /// Exit status: 0 valid, restored, or left empty for a fresh start (empty store); 1 failed;
    /// 64 bad configuration.
    Initialize,
}

#[derive(Args, Default)]
struct CopyArgs {
    /// Source store URL (source_store.url); SOURCE_-prefixed provider variables configure it.
    #[arg(long, value_name = "URL")]
    source_store: Option<String>,
    /// Destination store URL (store.url).
    #[arg(long, value_name = "URL")]
    dest_store: Option<String>,
    /// Wait for the source's final snapshot first (copy.wait_for_final).
    #[arg(long)]
    wait_for_final: bool,
    /// Copy anyway after waiting this long (copy.final_timeout), e.g. 30m.
    #[arg(long, value_name = "DURATION")]
    final_timeout: Option<String>,
    /// How often to look for the final snapshot (copy.poll_interval), e.g. 15s.
    #[arg(long, value_name = "DURATION")]
    poll_interval: Option<String>,
    /// Only the newest N full snapshots and their deltas (copy.max_backups; 0 = all).
    #[arg(long, value_name = "N")]
    max_backups: Option<String>,
    /// Only snapshots younger than this (copy.max_age), e.g. 7d.
    #[arg(long, value_name = "DURATION")]
    max_age: Option<String>,
    /// Objects copied at once (copy.parallel).
    #[arg(long, value_name = "N")]
    parallel: Option<String>,
}

impl CopyArgs {
    fn overrides(&self) -> Vec<Override> {
        let mut o = given(&[
            (&self.source_store, "source_store.url", "--source-store"),
            (&self.dest_store, "store.url", "--dest-store"),
            (&self.final_timeout, "copy.final_timeout", "--final-timeout"),
            (&self.poll_interval, "copy.poll_interval", "--poll-interval"),
            (&self.max_backups, "copy.max_backups", "--max-backups"),
            (&self.max_age, "copy.max_age", "--max-age"),
            (&self.parallel, "copy.parallel", "--parallel"),
        ]);
        o.extend(switched(&[(
            self.wait_for_final,
            "copy.wait_for_final",
            "true",
            "--wait-for-final",
        )]));
        o
    }
}

#[derive(Args, Default)]
struct RestoreArgs {
    /// Data directory to create (restore.data_dir).
    #[arg(long, value_name = "DIR")]
    data_dir: Option<String>,
    /// Member name (restore.name).
    #[arg(long, value_name = "NAME")]
    name: Option<String>,
    /// name=peerURL,... of the new cluster (restore.initial_cluster).
    #[arg(long, value_name = "CLUSTER")]
    initial_cluster: Option<String>,
    /// Token of the new cluster (restore.initial_cluster_token).
    #[arg(long, value_name = "TOKEN")]
    initial_cluster_token: Option<String>,
    /// This member's peer URLs (restore.initial_advertise_peer_urls).
    #[arg(long, value_name = "URLS")]
    initial_advertise_peer_urls: Option<String>,
    /// Directory of etcd and etcdutl/etcdctl (restore.etcd_bin); default PATH.
    #[arg(long, value_name = "DIR")]
    etcd_bin: Option<String>,
    /// Move a non-empty data directory aside instead of refusing (restore.force).
    #[arg(long)]
    force: bool,
    /// Fail when the latest full snapshot fails verification instead of falling back to the
    /// previous one (restore.fallback = false).
    #[arg(long)]
    no_fallback: bool,
    /// Restore the state at this revision: the newest full snapshot at or before it and every
    /// delta event up to and including it (a transaction is one revision: all of it).
    #[arg(long, value_name = "REVISION", value_parser = clap::value_parser!(i64).range(1..))]
    to_revision: Option<i64>,
    /// Restore the state at this time (RFC 3339, e.g. 2026-11-26T10:04:59Z): every delta event
    /// the sidecar had received by then, and the rest of the last revision among them.
    #[arg(long, value_name = "RFC3339", conflicts_with = "to_revision", value_parser = rfc3339)]
    to_time: Option<chrono::DateTime<chrono::Utc>>,
    /// etcd starts N revisions above the restored data, so every revision it hands out is new
    /// to clients that saw the source (restore.bump_revision; etcdutl's --bump-revision). For
    /// Kubernetes, 1000000000 with --mark-compacted.
    #[arg(long, value_name = "N")]
    bump_revision: Option<String>,
    /// Mark the bumped revision compacted: a watch or read at a revision the source served
    /// fails as compacted instead of missing events (restore.mark_compacted; needs
    /// --bump-revision).
    #[arg(long)]
    mark_compacted: bool,
}

#[derive(Args, Default)]
struct QuorumRestoreArgs {
    /// This member's data directory (restore.data_dir): rebuilt, the original kept aside as
    /// <DIR>.before-quorum-restore-<unix-time>.
    #[arg(long, value_name = "DIR")]
    data_dir: Option<String>,
    /// Another survivor's data directory (copied from its machine, its etcd stopped); only
    /// read. Repeatable: the one with the highest committed raft index is rebuilt from.
    #[arg(long = "survivor-data-dir", value_name = "DIR")]
    survivors: Vec<PathBuf>,
    /// This member's name in the rebuilt cluster; default the name in its member record.
    #[arg(long, value_name = "NAME")]
    name: Option<String>,
    /// This member's peer URLs in the rebuilt cluster; default those of its member record.
    #[arg(long, value_name = "URLS")]
    initial_advertise_peer_urls: Option<String>,
    /// Store URL (store.url) to check for a hand-off and to compare with; default: the
    /// configured store when --config is given, else none.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// How long a majority of the members must stay unreachable (quorum_restore.lost_for,
    /// default 5m).
    #[arg(long, value_name = "DURATION")]
    lost_for: Option<String>,
    /// How often the members are probed meanwhile (quorum_restore.probe_interval, default 5s).
    #[arg(long, value_name = "DURATION")]
    probe_interval: Option<String>,
    /// etcd starts N revisions above the survivor's data (restore.bump_revision).
    #[arg(long, value_name = "N")]
    bump_revision: Option<String>,
    /// Mark the bumped revision compacted (restore.mark_compacted; needs --bump-revision).
    #[arg(long)]
    mark_compacted: bool,
    /// Rebuild even when the survivor is behind the store's newest snapshot.
    #[arg(long)]
    force: bool,
    /// Directory of etcd and etcdutl/etcdctl (restore.etcd_bin); default PATH.
    #[arg(long, value_name = "DIR")]
    etcd_bin: Option<String>,
    /// Whether a store is to be read: --store or --config given (set by `run`).
    #[arg(skip)]
    use_store: bool,
}

impl QuorumRestoreArgs {
    fn overrides(&self) -> Vec<Override> {
        let mut o = given(&[
            (&self.data_dir, "restore.data_dir", "--data-dir"),
            (&self.store, "store.url", "--store"),
            (&self.etcd_bin, "restore.etcd_bin", "--etcd-bin"),
            (&self.lost_for, "quorum_restore.lost_for", "--lost-for"),
            (
                &self.probe_interval,
                "quorum_restore.probe_interval",
                "--probe-interval",
            ),
            (
                &self.bump_revision,
                "restore.bump_revision",
                "--bump-revision",
            ),
        ]);
        o.extend(switched(&[(
            self.mark_compacted,
            "restore.mark_compacted",
            "true",
            "--mark-compacted",
        )]));
        o
    }
}

/// The flags given (`Some`) as overrides of their configuration keys: (value, key, flag).
fn given(flags: &[(&Option<String>, &str, &str)]) -> Vec<Override> {
    flags
        .iter()
        .filter_map(|(v, key, flag)| v.as_ref().map(|v| Override::flag(key, v, flag)))
        .collect()
}

/// The switches that are on, each setting its key to its value: (on, key, value, flag).
fn switched(switches: &[(bool, &str, &str, &str)]) -> impl Iterator<Item = Override> {
    switches
        .iter()
        .filter(|(on, ..)| *on)
        .map(|(_, key, value, flag)| Override::flag(key, *value, flag))
}

/// An RFC 3339 time, as `--to-time` takes it.
fn rfc3339(s: &str) -> Result<chrono::DateTime<chrono::Utc>, String> {
    chrono::DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&chrono::Utc))
        .map_err(|e| format!("{s:?} is not an RFC 3339 time such as 2026-11-26T10:04:59Z: {e}"))
}

impl RestoreArgs {
    fn overrides(&self) -> Vec<Override> {
        let mut o = given(&[
            (&self.data_dir, "restore.data_dir", "--data-dir"),
            (&self.name, "restore.name", "--name"),
            (
                &self.initial_cluster,
                "restore.initial_cluster",
                "--initial-cluster",
            ),
            (
                &self.initial_cluster_token,
                "restore.initial_cluster_token",
                "--initial-cluster-token",
            ),
            (
                &self.initial_advertise_peer_urls,
                "restore.initial_advertise_peer_urls",
                "--initial-advertise-peer-urls",
            ),
            (&self.etcd_bin, "restore.etcd_bin", "--etcd-bin"),
            (
                &self.bump_revision,
                "restore.bump_revision",
                "--bump-revision",
            ),
        ]);
        o.extend(switched(&[
            (self.force, "restore.force", "true", "--force"),
            (
                self.no_fallback,
                "restore.fallback",
                "false",
                "--no-fallback",
            ),
            (
                self.mark_compacted,
                "restore.mark_compacted",
                "true",
                "--mark-compacted",
            ),
        ]));
        o
    }

    /// The point in time asked for, if any (a subcommand argument, not configuration: `serve`
    /// always restores the latest).
    fn target(&self) -> Option<etcd_warden::restore::Target> {
        use etcd_warden::restore::Target;
        self.to_revision
            .map(Target::Revision)
            .or(self.to_time.map(Target::Time))
    }
}

/// Which configured store a reading subcommand reads.
#[derive(Args, Default)]
struct WhichStore {
    /// Read the secondary store ([store.secondary]) instead of [store]. Only for commands that
    /// read snapshots: hand-off records stay on the primary, so reclaim and compact have no
    /// such flag.
    #[arg(long)]
    secondary: bool,
}

#[derive(Args, Default)]
struct StoreArg {
    /// Store URL (store.url), e.g. file:///var/backups/etcd or s3://bucket/prefix.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
}

impl Command {
    fn overrides(&self) -> Vec<Override> {
        match self {
            Command::Ls { store, .. } | Command::Reclaim { store } => store
                .store
                .iter()
                .map(|u| Override::flag("store.url", u, "--store"))
                .collect(),
            Command::Copy(args) => args.overrides(),
            Command::Compact {
                store, etcd_bin, ..
            }
            | Command::Verify {
                store, etcd_bin, ..
            } => store
                .store
                .iter()
                .map(|u| Override::flag("store.url", u, "--store"))
                .chain(
                    etcd_bin
                        .iter()
                        .map(|d| Override::flag("restore.etcd_bin", d, "--etcd-bin")),
                )
                .collect(),
            Command::QuorumRestore(args) => args.overrides(),
            Command::Restore { store, restore, .. } => store
                .store
                .iter()
                .map(|u| Override::flag("store.url", u, "--store"))
                .chain(restore.overrides())
                .collect(),
            _ => Vec::new(),
        }
    }

    /// What the subcommand needs of the configuration, validated with the rest.
    fn purpose(&self) -> Purpose {
        match self {
            Command::Serve => Purpose::Serve,
            Command::Copy(_) => Purpose::Copy,
            Command::Restore { .. } | Command::Initialize | Command::QuorumRestore(_) => {
                Purpose::Restore
            }
            Command::Config
            | Command::Snapshot { .. }
            | Command::Ls { .. }
            | Command::Verify { .. }
            | Command::Reclaim { .. }
            | Command::Compact { .. } => Purpose::Any,
        }
    }
}

impl Global {
    fn overrides(&self) -> Vec<Override> {
        let mut o = Vec::new();
        if let Some(v) = &self.log_level {
            o.push(Override::flag("log.level", v, "--log-level"));
        }
        if let Some(v) = &self.log_format {
            o.push(Override::flag("log.format", v, "--log-format"));
        }
        o
    }
}

/// glibc's malloc, tuned for a process that streams through short-lived buffers of 32 KiB to
/// 5 MiB on several threads: left alone it raises its mmap threshold after the first large
/// buffer is freed, so later ones come from the heap and fragment it, and each thread that
/// allocates gets an arena of its own that keeps what it freed. That made a snapshot's peak
/// RSS grow with the database (57 MiB at 100 MiB, 76 MiB at 1 GiB); with buffers of 128 KiB and
/// more mapped and unmapped, and two arenas, it stays flat (docs/benchmarks.md). The
/// `MALLOC_MMAP_THRESHOLD_` and `MALLOC_ARENA_MAX` environment variables still win.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune_malloc() {
    use nix::libc;
    const MMAP_THRESHOLD: libc::c_int = 128 << 10;
    const ARENA_MAX: libc::c_int = 2;
    for (var, param, value) in [
        (
            "MALLOC_MMAP_THRESHOLD_",
            libc::M_MMAP_THRESHOLD,
            MMAP_THRESHOLD,
        ),
        ("MALLOC_ARENA_MAX", libc::M_ARENA_MAX, ARENA_MAX),
    ] {
        if std::env::var_os(var).is_none() {
            // SAFETY: mallopt only sets allocator parameters; it is called before any thread
            // is started. Its result (0 if the value is refused) changes nothing we rely on.
            unsafe {
                libc::mallopt(param, value);
            }
        }
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_malloc() {}

fn main() -> ExitCode {
    // Before the configuration (and with it any secret) is read.
    if let Err(e) = etcd_warden::hardening::forbid_inspection() {
        eprintln!("etcd-warden: {e}");
        return ExitCode::FAILURE;
    }
    tune_malloc();
    // A planted defect the seam does not know is refused before anything runs: a typo must
    // never read as a plant the harness failed to catch (debug builds only; see `plant`).
    if let Err(e) = etcd_warden::plant::check() {
        eprintln!("etcd-warden: {e}");
        return ExitCode::from(EXIT_CONFIG);
    }
    let invoked_as = std::env::args_os()
        .next()
        .and_then(|a| {
            std::path::Path::new(&a)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
        })
        .unwrap_or_default();
    let outcome = if invoked_as == "etcdbrctl" {
        let args: Vec<String> = std::env::args().skip(1).collect();
        etcdbrctl(&args)
    } else {
        run(Cli::parse())
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The whole chain on one line: what failed and why.
            let msg = format!("{e:#}");
            eprintln!("etcd-warden: {}", msg.replace('\n', " "));
            if e.downcast_ref::<ConfigError>().is_some() {
                ExitCode::from(EXIT_CONFIG)
            } else if let Some(d) = e.downcast_ref::<Degraded>() {
                ExitCode::from(d.status)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

fn run(mut cli: Cli) -> anyhow::Result<()> {
    if let Command::QuorumRestore(args) = &mut cli.command {
        args.use_store = args.store.is_some() || cli.global.config.is_some();
    }
    let mut overrides = cli.global.overrides();
    overrides.extend(cli.command.overrides());
    let sources = Sources {
        file: cli.global.config.as_deref(),
        env: &ProcessEnv,
        overrides,
    };
    let (config, raw) = Config::load_for(&sources, cli.command.purpose())?;
    let config = match &cli.command {
        Command::Ls { which, .. }
        | Command::Verify { which, .. }
        | Command::Restore { which, .. }
            if which.secondary =>
        {
            config.reading_secondary()?
        }
        _ => config,
    };
    etcd_warden::telemetry::init(&config.log);
    if let Command::Config = cli.command {
        print!("{}", raw.to_redacted_toml());
        return Ok(());
    }
    execute(config, cli.command)
}

/// `etcdbrctl <subcommand> <flags>`: etcd-backup-restore's command line (etcd_warden::etcdbrctl)
/// as the equivalent etcd-warden command and configuration. A command line etcdbrctl would
/// refuse, or one asking for what etcd-warden cannot do, exits 64 naming the flag.
fn etcdbrctl(args: &[String]) -> anyhow::Result<()> {
    use etcd_warden::etcdbrctl::{ProcessEnvironment, Subcommand, translate};
    if args.iter().any(|a| a == "-v" || a == "--version") {
        println!("etcdbrctl (etcd-warden {})", env!("CARGO_PKG_VERSION"));
        return Ok(());
    }
    let t = translate(args, &ProcessEnvironment).map_err(|e| ConfigError::new("etcdbrctl", e.0))?;
    let file = std::env::var_os("ETCD_WARDEN_CONFIG").map(PathBuf::from);
    let (command, purpose) = match t.command {
        Subcommand::Server | Subcommand::Snapshot => (Command::Serve, Purpose::Serve),
        Subcommand::Restore => (
            Command::Restore {
                store: StoreArg::default(),
                which: WhichStore::default(),
                restore: RestoreArgs::default(),
            },
            Purpose::Restore,
        ),
        Subcommand::Compact => {
            let work_dir = t.value("restore.data_dir").map(PathBuf::from);
            if let Some(dir) = &work_dir {
                std::fs::create_dir_all(dir).map_err(|e| {
                    anyhow::anyhow!("cannot create --data-dir {}: {e}", dir.display())
                })?;
            }
            let compact = Command::Compact {
                store: StoreArg::default(),
                work_dir,
                etcd_bin: None,
            };
            (compact, Purpose::Any)
        }
        Subcommand::Copy => (Command::Copy(CopyArgs::default()), Purpose::Copy),
        Subcommand::Initialize => (Command::Initialize, Purpose::Restore),
    };
    let sources = Sources {
        file: file.as_deref(),
        env: &ProcessEnv,
        overrides: t.overrides.clone(),
    };
    let (config, _) = Config::load_for(&sources, purpose)?;
    etcd_warden::telemetry::init(&config.log);
    tracing::info!(command = t.command.name(), as_ = ?command_name(&command), "etcdbrctl command line translated");
    for ignored in &t.ignored {
        tracing::info!(flag = %ignored.flag, reason = ignored.reason, "etcdbrctl flag accepted without effect");
    }
    execute(config, command)
}

/// The etcd-warden subcommand an etcdbrctl command runs as, for the log.
fn command_name(c: &Command) -> &'static str {
    match c {
        Command::Serve => "serve",
        Command::Restore { .. } => "restore",
        Command::Compact { .. } => "compact",
        Command::Copy(_) => "copy",
        Command::Initialize => "initialize",
        _ => "other",
    }
}

/// Runs `command` with `config` until it ends or a signal stops it.
fn execute(config: Config, command: Command) -> anyhow::Result<()> {
    let cli = Cli {
        global: Global {
            config: None,
            log_level: None,
            log_format: None,
        },
        command,
    };
    let is_serve = matches!(cli.command, Command::Serve);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let cancel = CancellationToken::new();
        tokio::spawn(cancel_on_signal(cancel.clone()));
        let one_shot = async {
            match cli.command {
                Command::Config => Ok(()),
                Command::Serve => {
                    etcd_warden::sidecar::run(config, cancel.clone()).await?;
                    Ok(())
                }
                Command::Snapshot { r#final } => ops::snapshot(&config, r#final).await,
                Command::Ls { json, .. } => ops::ls(&config, json).await,
                Command::Verify {
                    restore, work_dir, ..
                } => {
                    let checked = ops::verify(&config).await;
                    if !restore {
                        return checked;
                    }
                    // The drill runs even when a snapshot elsewhere in the store failed: it
                    // says whether the newest chain restores.
                    let drilled = ops::drill(&config, config.restore.work_dir(work_dir)).await;
                    reported(&config, Job::Drill, checked.and(drilled)).await
                }
                Command::Reclaim { .. } => ops::reclaim(&config).await,
                Command::Copy(_) => reported(&config, Job::Copy, ops::copy(&config).await).await,
                Command::Restore { restore, .. } => {
                    let done = ops::restore(&config, restore.target()).await;
                    reported(&config, Job::Restore, done).await
                }
                Command::Compact { work_dir, .. } => {
                    let done = ops::compact(&config, config.restore.work_dir(work_dir)).await;
                    reported(&config, Job::Compact, done).await
                }
                Command::Initialize => ops::initialize(&config).await,
                Command::QuorumRestore(args) => {
                    let done = ops::quorum_restore(&config, &args).await;
                    reported(&config, Job::QuorumRestore, done).await
                }
            }
        };
        if is_serve {
            return one_shot.await;
        }
        // A one-shot command stopped by a signal is dropped where it is: its temporary etcd is
        // killed and its work directories removed (a compaction's holds a decrypted database;
        // a restore's partial directory is discarded by the next one), then it exits 1.
        tokio::select! {
            result = one_shot => result,
            () = cancel.cancelled() => anyhow::bail!("stopped by a signal before it finished"),
        }
    })
}

/// `result`, after its Event on the Job's pod (with `[kubernetes]`; see
/// `kubernetes::events::report_job`).
async fn reported(config: &Config, job: Job, result: anyhow::Result<()>) -> anyhow::Result<()> {
    let outcome = result.as_ref().map(|_| ()).map_err(|e| format!("{e:#}"));
    report_job(
        config,
        job,
        outcome.as_ref().map(|_| ()).map_err(String::as_str),
    )
    .await;
    result
}

/// Cancels `cancel` on SIGTERM (the kubelet stopping the pod) or SIGINT.
async fn cancel_on_signal(cancel: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers; stop with SIGKILL");
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
    cancel.cancel();
}

/// The one-shot ops commands.
mod ops {
    use anyhow::{Context, bail};
    use etcd_warden::config::Config;
    use etcd_warden::owner::handoff::{self, HandOffObjects, the_final};
    use etcd_warden::owner::resolve::{CheckResult, OwnerLookup, OwnerResolver};
    use etcd_warden::snapshot::{take_full, verify::verify as verify_one};
    use etcd_warden::store::{Codec, Listing, SnapshotStore, layout};

    /// What the owner record says now, when ownership checks are configured.
    async fn owner_record(config: &Config) -> anyhow::Result<Option<CheckResult>> {
        let Some(owner) = &config.owner else {
            return Ok(None);
        };
        let resolver = OwnerResolver::new(owner)?;
        Ok(Some(resolver.check().await))
    }

    /// The owner record's name, for messages.
    fn record_name(config: &Config) -> &str {
        config.owner.as_ref().map_or("", |o| o.name.as_str())
    }

    pub async fn snapshot(config: &Config, is_final: bool) -> anyhow::Result<()> {
        if is_final && let Some(found) = owner_record(config).await? {
            handoff::may_take_final_by_hand(
                record_name(config),
                found.verdict(),
                &found.to_string(),
            )?;
        }
        let store = snapshots(config)?;
        if config.owner.is_some() {
            let hold = HandOffObjects::new(store.clone())
                .hold()
                .await
                .with_context(|| {
                    format!("reading the hand-off objects in {}", config.store.location)
                })?;
            handoff::may_snapshot_by_hand(
                hold.as_ref(),
                is_final,
                &config.store.location.to_string(),
                record_name(config),
            )?;
        }
        let client = etcd_warden::etcd::connect(&config.etcd).await?;
        let snap = take_full(
            &client,
            &store,
            Codec::from(config.snapshot.compression),
            is_final,
        )
        .await
        .context("full snapshot failed")?;
        println!("{}", snap.snap_name);
        Ok(())
    }

    /// The configured store, encrypting and decrypting with the configured keys.
    fn snapshots(config: &Config) -> anyhow::Result<SnapshotStore> {
        Ok(SnapshotStore::from_config(&config.store)?
            .with_encryption(config.encryption.clone())
            .with_compression_level(config.snapshot.compression_level)
            .with_read_limits(config.restore.read_limits))
    }

    pub async fn reclaim(config: &Config) -> anyhow::Result<()> {
        ensure_may_reclaim(config).await?;
        let store = snapshots(config)?;
        let done = handoff::reclaim(&handoff::HandOffObjects::new(store))
            .await
            .with_context(|| format!("reclaiming the hand-off in {}", config.store.location))?;
        for f in &done.fences_removed {
            println!("removed fence marker {f}");
        }
        for f in &done.finals_reclaimed {
            println!("reclaimed final snapshot {f}");
        }
        println!(
            "reclaimed: restart the sidecars of this cluster; they become Active when the owner record names them"
        );
        Ok(())
    }

    /// The store's listing with `is_final` as every reader decides it: true only for the
    /// hand-off's final ([`the_final`]), never for a reclaimed or superseded `.final` object.
    async fn listed_as_read(
        config: &Config,
        store: &SnapshotStore,
    ) -> anyhow::Result<(Listing, Option<String>)> {
        let mut listing = store
            .listing()
            .await
            .with_context(|| format!("listing {}", config.store.location))?;
        let seen = HandOffObjects::new(store.clone())
            .seen()
            .await
            .with_context(|| {
                format!("reading the hand-off objects of {}", config.store.location)
            })?;
        let the = the_final(&listing.snapshots(), &seen).map(|s| s.snap_name.clone());
        for (s, _) in &mut listing.snapshots {
            s.is_final = the.as_deref() == Some(s.snap_name.as_str());
        }
        Ok((listing, the))
    }

    pub async fn ls(config: &Config, json: bool) -> anyhow::Result<()> {
        let store = snapshots(config)?;
        let (listing, _) = listed_as_read(config, &store).await?;
        // etcd-druid's requested finals (`.final` by name, no hand-off's): FINAL says "druid".
        let druids = etcd_warden::store::gc::requested_finals(&store)
            .await
            .with_context(|| {
                format!("listing the requested finals of {}", config.store.location)
            })?;
        if json {
            // One array, as before: the unrecognised objects (`"kind": "Unrecognised"`) first,
            // so `.[-1]` stays the newest snapshot.
            let mut entries: Vec<serde_json::Value> = Vec::new();
            for u in &listing.unrecognised {
                entries.push(serde_json::to_value(u)?);
            }
            for (s, _) in &listing.snapshots {
                entries.push(serde_json::to_value(s)?);
            }
            println!("{}", serde_json::to_string_pretty(&entries)?);
            return Ok(());
        }
        println!(
            "{:<4} {:>10} {:>10}  {:<20}  {:<5}  {:<9}  NAME",
            "KIND", "START", "LAST", "CREATED", "FINAL", "ENCRYPTED"
        );
        for (s, _) in &listing.snapshots {
            println!(
                "{:<4} {:>10} {:>10}  {:<20}  {:<5}  {:<9}  {}",
                s.kind,
                s.start_revision,
                s.last_revision,
                s.created_on.format("%Y-%m-%dT%H:%M:%SZ"),
                match (s.is_final, druids.contains(&s.snap_name)) {
                    (true, _) => "yes",
                    (false, true) => "druid",
                    (false, false) => "",
                },
                if s.encrypted { "yes" } else { "" },
                s.snap_name
            );
        }
        if !listing.unrecognised.is_empty() {
            println!();
            println!(
                "UNRECOGNISED: {} object(s) whose names are not snapshot names; restore, copy and retention ignore them",
                listing.unrecognised.len()
            );
            for u in &listing.unrecognised {
                println!("?    {}  ({})", u.name, u.reason);
            }
        }
        Ok(())
    }

    pub async fn copy(config: &Config) -> anyhow::Result<()> {
        let report = etcd_warden::copy::run_from_config(config)
            .await
            .context("copy failed")?;
        eprintln!(
            "copied {} snapshots, {} already there ({} selected)",
            report.copied, report.skipped, report.selected
        );
        if !report.unrecognised.is_empty() {
            eprintln!(
                "not copied: {} object(s) in the source whose names are not snapshot names: {}",
                report.unrecognised.len(),
                report.unrecognised.join(", ")
            );
        }
        Ok(())
    }

    /// Refuses unless this seed may take the data over: the owner record, when there is one,
    /// names it (`handoff::may_reclaim`).
    async fn ensure_may_reclaim(config: &Config) -> anyhow::Result<()> {
        if let Some(found) = owner_record(config).await? {
            handoff::may_reclaim(
                record_name(config),
                config.owner.as_ref().map_or("", |o| o.id.as_str()),
                found.verdict(),
                &found.to_string(),
            )?;
        }
        Ok(())
    }

    /// Says where etcd starts when `restore.bump_revision` moved it above the restored `revision`.
    fn print_bump(config: &Config, revision: i64, etcd_revision: i64) {
        if etcd_revision != revision {
            println!(
                "etcd starts at revision {etcd_revision} (bumped by {}{})",
                etcd_revision - revision,
                if config.restore.mark_compacted {
                    ", marked compacted"
                } else {
                    ""
                }
            );
        }
    }

    /// `restore.data_dir`, which `Purpose::Restore` has required: this only unwraps the Option.
    fn restore_data_dir(config: &Config) -> anyhow::Result<&std::path::Path> {
        config
            .restore
            .data_dir
            .as_deref()
            .context("restore.data_dir is not set")
    }

    pub async fn restore(
        config: &Config,
        to: Option<etcd_warden::restore::Target>,
    ) -> anyhow::Result<()> {
        let data_dir = restore_data_dir(config)?;
        let store = snapshots(config)?;
        let mut opts = etcd_warden::restore::RestoreOptions::from_config(&config.restore, data_dir);
        opts.to = to;
        let report = etcd_warden::restore::restore(&store, &opts).await?;
        println!(
            "restored {} from {} and {} deltas ({} events replayed) at revision {}",
            data_dir.display(),
            report.full_snapshot,
            report.deltas,
            report.events_applied,
            report.revision
        );
        if let Some(target) = to {
            let when = report.last_event_time.map_or(String::new(), |t| {
                format!(", the last event received at {}", t.to_rfc3339())
            });
            println!(
                "the state at {target}: revision {}{when}; later events in the store are not restored",
                report.revision
            );
        }
        print_bump(config, report.revision, report.etcd_revision);
        for skipped in &report.skipped {
            println!(
                "skipped full snapshot {}: {}",
                skipped.snapshot, skipped.reason
            );
        }
        if report.revision < report.store_revision {
            println!(
                "reached revision {} of the store's {}: revisions {} to {} are not restored",
                report.revision,
                report.store_revision,
                report.revision + 1,
                report.store_revision
            );
        }
        if let Some(old) = &report.moved_aside {
            println!("the previous data directory is at {}", old.display());
        }
        if let Some(newest) = report.skipped.first() {
            // Done, yet not what a script asked for: it must not pass for a clean restore.
            return Err(super::Degraded {
                status: super::EXIT_RESTORED_OLDER,
                message: format!(
                    "restored {} from an older full snapshot, {}, at revision {}: {} full snapshot(s) fail verification, the newest {} (exit status {}; --no-fallback fails instead)",
                    data_dir.display(),
                    report.full_snapshot,
                    report.revision,
                    report.skipped.len(),
                    newest.snapshot,
                    super::EXIT_RESTORED_OLDER
                ),
            }
            .into());
        }
        Ok(())
    }

    /// `quorum-restore`: the freshest survivor rebuilt as a one-member cluster.
    pub async fn quorum_restore(
        config: &Config,
        args: &super::QuorumRestoreArgs,
    ) -> anyhow::Result<()> {
        use etcd_warden::restore::quorum::{self, QuorumOptions, Rebuilt, StoreCheck};
        let data_dir = restore_data_dir(config)?;
        // A hand-off is the owner record's business as much as the store's: as for reclaim,
        // this seed must own the data it revives.
        ensure_may_reclaim(config).await?;
        let store = if args.use_store {
            Some(snapshots(config)?)
        } else {
            None
        };
        let opts = QuorumOptions {
            data_dir: data_dir.to_path_buf(),
            survivors: args.survivors.clone(),
            name: args.name.clone(),
            initial_advertise_peer_urls: args.initial_advertise_peer_urls.clone(),
            initial_cluster_token: config.restore.initial_cluster_token.clone(),
            etcd_bin: config.restore.etcd_bin.clone(),
            lost_for: config.quorum_restore.lost_for,
            probe_interval: config.quorum_restore.probe_interval,
            bump: etcd_warden::restore::RevisionBump {
                by: config.restore.bump_revision,
                mark_compacted: config.restore.mark_compacted,
            },
            force: args.force,
        };
        let check = store.as_ref().map(|store| StoreCheck {
            store,
            location: config.store.location.to_string(),
            owner_record: record_name(config).to_owned(),
        });
        let report = quorum::quorum_restore(&opts, check).await?;
        for (path, committed) in &report.survivors {
            println!(
                "survivor {}: committed raft index {committed}",
                path.display()
            );
        }
        println!(
            "quorum lost: a majority of the members stayed unreachable for {} ({} probes)",
            humantime::format_duration(config.quorum_restore.lost_for),
            report.probes
        );
        println!(
            "chose {} (member {}): committed raft index {}, revision {}",
            report.chosen.display(),
            report.chosen_member,
            report.committed,
            report.revision
        );
        match report.rebuilt {
            Rebuilt::ForceNewCluster => println!(
                "rebuilt {} as a one-member cluster with etcd --force-new-cluster on a copy",
                data_dir.display()
            ),
            Rebuilt::Restored => println!(
                "rebuilt {} as a one-member cluster: etcd --force-new-cluster on a copy, snapshotted and restored as this member",
                data_dir.display()
            ),
        }
        print_bump(config, report.revision, report.etcd_revision);
        if !report.dropped.is_empty() {
            println!("members dropped: {}", report.dropped.join(", "));
        }
        println!(
            "the original data directory is kept at {}",
            report.kept_at.display()
        );
        match (&report.store, report.store_would_lose()) {
            (Some(s), Some(lost)) => println!(
                "the store's newest snapshot {} is at revision {}: a restore from the store would have lost {lost} revisions",
                s.snapshot, s.revision
            ),
            _ => println!("no store compared (give --store or --config)"),
        }
        println!(
            "next: start this member's etcd on {}; the other members rejoin as learners (`etcd-warden initialize` with restore.cluster_endpoints on each)",
            data_dir.display()
        );
        Ok(())
    }

    /// `initialize`: `serve`'s data-directory check and restore, once.
    pub async fn initialize(config: &Config) -> anyhow::Result<()> {
        let store = snapshots(config)?;
        let cancel = tokio_util::sync::CancellationToken::new();
        let metrics = etcd_warden::restore::initialize::InitializeMetrics::default();
        let rejoined = etcd_warden::restore::rejoin::rejoin_if_lost(
            &config.restore,
            &metrics,
            &store,
            &cancel,
        )
        .await?;
        if rejoined {
            println!("rejoined the cluster as a learner and was promoted");
            return Ok(());
        }
        let secondary = etcd_warden::restore::initialize::secondary_store(config)?;
        let done = etcd_warden::restore::initialize::initialize_from(
            &store,
            secondary.as_ref(),
            &config.restore,
            &metrics,
        )
        .await?;
        println!("{done:?}");
        Ok(())
    }

    pub async fn compact(config: &Config, work_dir: std::path::PathBuf) -> anyhow::Result<()> {
        use etcd_warden::compact::{CompactOptions, CompactReport};
        let store = snapshots(config)?;
        let opts = CompactOptions {
            work_dir,
            etcd_bin: config.restore.etcd_bin.clone(),
            codec: Codec::from(config.snapshot.compression),
            parallel_fetch: config.restore.parallel_fetch,
        };
        match etcd_warden::compact::compact(&store, &opts)
            .await
            .context("compact failed")?
        {
            CompactReport::NothingToDo { latest_full } => println!(
                "nothing to compact: {}",
                latest_full.map_or("the store has no full snapshot".into(), |f| format!(
                    "no delta after {f}"
                ))
            ),
            CompactReport::Compacted {
                from_full,
                deltas,
                snapshot,
                db_size_before,
                db_size_after,
                seconds,
            } => {
                println!(
                    "stored {} (revision {}): {from_full} and {deltas} deltas, database {} → {} MiB, {seconds:.1}s",
                    snapshot.snap_name,
                    snapshot.last_revision,
                    db_size_before >> 20,
                    db_size_after >> 20
                );
                full_snapshot_lease(config, &snapshot).await?;
            }
        }
        Ok(())
    }

    /// Under etcd-druid (`etcdbrctl compact --enable-snapshot-lease-renewal`): the full snapshot
    /// Lease names the compacted snapshot, so druid's compaction controller sees the events
    /// folded. Tried three times; the snapshot is stored either way, but the Job fails when the
    /// Lease cannot be written (druid would otherwise compact the same events again).
    async fn full_snapshot_lease(
        config: &Config,
        snapshot: &etcd_warden::store::Snapshot,
    ) -> anyhow::Result<()> {
        let Some(d) = config.druid.as_ref().filter(|d| d.snapshot_leases) else {
            return Ok(());
        };
        let namespace = d
            .pod_namespace
            .as_deref()
            .context("druid.pod_namespace (POD_NAMESPACE) is required by the Leases")?;
        let client = kube::Client::try_default()
            .await
            .context("a Kubernetes client for the full snapshot Lease")?;
        let api: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
            kube::Api::namespaced(client, namespace);
        let mut last = None;
        for attempt in 0..3 {
            if attempt > 0 {
                tokio::time::sleep(std::time::Duration::from_secs(2)).await;
            }
            match etcd_warden::druid::lease::update_full(
                &api,
                &d.full_snapshot_lease,
                snapshot.last_revision,
                snapshot.created_on,
            )
            .await
            {
                Ok(written) => {
                    println!(
                        "Lease {}: {}",
                        d.full_snapshot_lease,
                        if written {
                            format!("revision {}", snapshot.last_revision)
                        } else {
                            "already at a newer revision".into()
                        }
                    );
                    return Ok(());
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("three attempts")).context("writing the full snapshot Lease")
    }

    pub async fn verify(config: &Config) -> anyhow::Result<()> {
        let store = snapshots(config)?;
        let (listing, the) = listed_as_read(config, &store).await?;
        let list = listing.snapshots();
        let mut failed = Vec::new();
        for s in &list {
            match verify_one(&store, s).await {
                Ok(v) if v.events > 0 => println!("ok    {}  ({} events)", s.snap_name, v.events),
                Ok(v) => println!("ok    {}  ({} bytes)", s.snap_name, v.payload_bytes),
                Err(e) => failed.push((s, e)),
            }
        }
        // Retention beside this Job may have deleted some since the listing: those are gone,
        // not bad. Unable to list again, every failure counts.
        let read_failed: Vec<_> = failed.iter().map(|(s, _)| *s).collect();
        let gone = etcd_warden::snapshot::verify::gone_since_listed(&store, &read_failed)
            .await
            .unwrap_or_else(|e| {
                println!(
                    "FAIL  listing the store again to tell deleted snapshots from bad ones: {e}"
                );
                Vec::new()
            });
        let mut bad = 0;
        for (s, e) in &failed {
            if gone.contains(&s.snap_name) {
                println!(
                    "gone  {}: deleted since it was listed (retention)",
                    s.snap_name
                );
            } else {
                bad += 1;
                println!("FAIL  {e}");
            }
        }
        for u in &listing.unrecognised {
            println!("FAIL  {}: not a snapshot name: {}", u.name, u.reason);
        }
        let gap = layout::first_gap(&layout::latest_chain(&list));
        if let Some(gap) = &gap {
            println!("FAIL  {gap}");
        }
        let mut problems = Vec::new();
        if bad > 0 {
            problems.push(format!(
                "{bad} of {} snapshots failed verification",
                list.len()
            ));
        }
        if !listing.unrecognised.is_empty() {
            problems.push(format!(
                "{} object(s) under {} are not snapshots (nothing restores or copies them): {}",
                listing.unrecognised.len(),
                layout::version_prefix(store.prefix()),
                listing.unrecognised_names().join(", ")
            ));
        }
        if let Some(gap) = gap {
            problems.push(gap.to_string());
        }
        if !problems.is_empty() {
            bail!("{}", problems.join("; "));
        }
        eprintln!("{} snapshots verified", list.len() - gone.len());
        if !gone.is_empty() {
            eprintln!("{} deleted while being verified", gone.len());
        }
        match the {
            Some(name) => eprintln!("the hand-off's final snapshot: {name}"),
            None => eprintln!("no hand-off final snapshot in this store"),
        }
        Ok(())
    }

    /// `verify --restore`: a restore drill of the newest chain, its outcome recorded in the
    /// store whatever it is.
    pub async fn drill(config: &Config, work_dir: std::path::PathBuf) -> anyhow::Result<()> {
        use etcd_warden::restore::drill::{self, DrillOptions};
        let store = snapshots(config)?;
        let opts = DrillOptions {
            work_dir,
            etcd_bin: config.restore.etcd_bin.clone(),
            parallel_fetch: config.restore.parallel_fetch,
        };
        let started = std::time::Instant::now();
        let outcome = drill::drill(&store, &opts).await;
        let took = started.elapsed();
        let error = outcome.as_ref().err().map(|e| e.to_string());
        let record = match drill::read_record(&store).await {
            Ok(r) => r,
            Err(e) => {
                // A damaged record must not hide this drill's outcome: start it again.
                tracing::warn!(error = %e, "the store's drill record cannot be read; starting a new one");
                Default::default()
            }
        };
        let record = record.after(
            outcome
                .as_ref()
                .map_err(|_| error.as_deref().unwrap_or_default()),
            chrono::Utc::now(),
            took,
        );
        let recorded = drill::write_record(&store, &record).await;
        match &outcome {
            Ok(r) => println!(
                "ok    restore drill: {} and {} deltas restored in {:.1}s; etcd serves revision {}, {} keys, sha256 {} (checked in {:.1}s)",
                r.full_snapshot,
                r.deltas,
                r.restore_seconds,
                r.revision,
                r.keys,
                r.hash,
                r.check_seconds
            ),
            Err(e) => println!("FAIL  restore drill: {e}"),
        }
        recorded.context("recording the drill's outcome in the store")?;
        outcome.context("restore drill failed")?;
        Ok(())
    }
}
