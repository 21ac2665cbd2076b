//! `etcd-warden`: parse flags, load and validate configuration, init telemetry, run a subcommand,
//! map the outcome to an exit status (0 ok, 64 bad configuration, 1 anything else).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use etcd_warden::config::{Config, ConfigError, Override, ProcessEnv, Sources};

/// Exit status for bad configuration (EX_USAGE).
const EXIT_CONFIG: u8 = 64;

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
    /// Print the effective configuration (every layer applied, secrets redacted) and exit.
    Config,
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The whole chain on one line: what failed and why.
            let msg = format!("{e:#}");
            eprintln!("etcd-warden: {}", msg.replace('\n', " "));
            if e.downcast_ref::<ConfigError>().is_some() {
                ExitCode::from(EXIT_CONFIG)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let overrides = cli.global.overrides();
    let sources = Sources {
        file: cli.global.config.as_deref(),
        env: &ProcessEnv,
        overrides,
    };
    let (config, raw) = Config::load(&sources)?;
    etcd_warden::telemetry::init(&config.log);
    match cli.command {
        Command::Config => {
            print!("{}", raw.to_redacted_toml());
            Ok(())
        }
    }
}
