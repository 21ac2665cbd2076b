//! The `etcd-warden` binary run as a child process, as it runs in a pod.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{eventually, free_port};

/// A running `etcd-warden serve` with its own listen port and log file.
pub struct Warden {
    pub port: u16,
    /// The address it listens on (`127.0.0.1` unless `server.listen` names another).
    pub host: String,
    pub log: PathBuf,
    child: Option<Child>,
    env: BTreeMap<String, String>,
    /// Run as this user ID instead of the test's.
    uid: Option<u32>,
    /// Another build of `etcd-warden` to run instead of this one.
    bin: Option<PathBuf>,
    /// Run as `etcdbrctl` with these arguments (and `env` as plain variables) instead of
    /// `serve` configured through `ETCD_WARDEN_*`.
    etcdbrctl: Option<Vec<String>>,
    pub dir: tempfile::TempDir,
}

/// The `etcd-warden` binary: Cargo's path for tests and benchmarks; for an example (which Cargo
/// gives no such path), the one built beside it (`target/<profile>/etcd-warden`).
pub fn binary() -> PathBuf {
    if let Some(path) = option_env!("CARGO_BIN_EXE_etcd-warden") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("path of the running executable");
    let profile_dir = exe
        .ancestors()
        .find(|d| d.file_name().is_some_and(|n| n == "examples"))
        .and_then(|d| d.parent())
        .unwrap_or_else(|| panic!("{} is not in target/<profile>/examples", exe.display()));
    let bin = profile_dir.join("etcd-warden");
    assert!(
        bin.is_file(),
        "{} not found; build it first: cargo build --bin etcd-warden",
        bin.display()
    );
    bin
}

/// `etcd-warden` with a clean environment: only what the test passes.
pub fn command() -> Command {
    command_of(&binary())
}

/// `etcd-warden <subcommand> --store <store> <dir_flag> <dir> --etcd-bin <etcd 3.5's>`, the
/// store reached with `s3`'s credentials: how the Jobs run `restore` and `compact`.
pub fn on_s3_store(
    subcommand: &str,
    s3: &super::s3::S3Server,
    store: &str,
    dir_flag: &str,
    dir: &std::path::Path,
) -> Command {
    let mut c = command();
    c.args([subcommand, "--store", store])
        .arg(dir_flag)
        .arg(dir)
        .arg("--etcd-bin")
        .arg(super::etcd::Release::V35.bin_dir())
        .envs(s3.env("store"));
    c
}

/// [`command`] for another build of `etcd-warden` (an older release, for mixed versions).
pub fn command_of(bin: &std::path::Path) -> Command {
    let mut c = Command::new(bin);
    for (k, _) in std::env::vars() {
        if k.starts_with("ETCD_WARDEN_")
            || k.starts_with("AWS_")
            || k.starts_with("AZURE_")
            || k.starts_with("GOOGLE_")
        {
            c.env_remove(k);
        }
    }
    c.env("RUST_LOG", "etcd_warden=debug,info");
    // A planted defect (`etcd_warden::plant`) reaches every sidecar and Job the harness starts:
    // `SOAK_PLANT` plants it in them alone (the harness's own process, which reads the store
    // with the same library, stays clean), `WARDEN_PLANT` in this process too.
    if let Some(plants) = std::env::var_os(CHILD_PLANT_ENV).or_else(|| std::env::var_os(PLANT_ENV))
    {
        c.env(PLANT_ENV, plants);
    }
    c
}

/// The variable that switches planted defects on (`etcd_warden::plant`; named here too because a
/// release build of the library does not export it).
pub const PLANT_ENV: &str = "WARDEN_PLANT";

/// Plants for the processes the harness starts only, passed to them as [`PLANT_ENV`].
pub const CHILD_PLANT_ENV: &str = "SOAK_PLANT";

impl Warden {
    /// Starts `serve` with these configuration keys (dotted, e.g. `store.url`) on top of test
    /// defaults: a free listen port, quick leader checks.
    pub fn start(keys: &[(&str, String)]) -> Warden {
        Self::start_as(keys, None)
    }

    /// [`Warden::start`] as another user (`uid`, e.g. 65534 "nobody"), as a sidecar that does not
    /// share etcd's UID runs.
    pub fn start_as(keys: &[(&str, String)], uid: Option<u32>) -> Warden {
        Self::start_with(keys, uid, None)
    }

    /// [`Warden::start`] with another build of `etcd-warden` (`bin`), e.g. the previous
    /// release during a rolling update.
    pub fn start_binary(keys: &[(&str, String)], bin: &std::path::Path) -> Warden {
        Self::start_with(keys, None, Some(bin.to_path_buf()))
    }

    fn start_with(keys: &[(&str, String)], uid: Option<u32>, bin: Option<PathBuf>) -> Warden {
        let port = free_port();
        let mut env = BTreeMap::new();
        env.insert("server.listen".to_string(), format!("127.0.0.1:{port}"));
        env.insert(
            "snapshot.leader_check_interval".to_string(),
            "200ms".to_string(),
        );
        for (k, v) in keys {
            env.insert(k.to_string(), v.clone());
        }
        let listen: std::net::SocketAddr = env["server.listen"]
            .parse()
            .expect("server.listen is an address");
        let dir = tempfile::tempdir().expect("temp dir");
        let log = dir.path().join("warden.log");
        let mut w = Warden {
            port: listen.port(),
            host: listen.ip().to_string(),
            log,
            child: None,
            env,
            uid,
            bin,
            etcdbrctl: None,
            dir,
        };
        w.spawn();
        w
    }

    /// The binary invoked as `etcdbrctl server --server-port=<free port> <args>` (as
    /// etcd-druid's StatefulSet runs etcd-backup-restore's image), with `env` as its
    /// environment.
    pub fn start_etcdbrctl(args: &[String], env: &[(&str, String)]) -> Warden {
        let port = free_port();
        let dir = tempfile::tempdir().expect("temp dir");
        let log = dir.path().join("warden.log");
        let mut argv = vec!["server".to_string(), format!("--server-port={port}")];
        argv.extend(args.iter().cloned());
        let mut w = Warden {
            port,
            host: "127.0.0.1".into(),
            log,
            child: None,
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
            uid: None,
            bin: None,
            etcdbrctl: Some(argv),
            dir,
        };
        w.spawn();
        w
    }

    fn spawn(&mut self) {
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        let mut cmd = match &self.bin {
            Some(bin) => command_of(bin),
            None => command(),
        };
        match &self.etcdbrctl {
            Some(argv) => {
                std::os::unix::process::CommandExt::arg0(&mut cmd, "etcdbrctl");
                cmd.args(argv).envs(&self.env);
            }
            None => {
                cmd.arg("serve");
                for (k, v) in &self.env {
                    cmd.env(
                        format!("ETCD_WARDEN_{}", k.replace('.', "_").to_ascii_uppercase()),
                        v,
                    );
                }
            }
        }
        if let Some(uid) = self.uid {
            std::os::unix::process::CommandExt::uid(&mut cmd, uid);
            std::os::unix::process::CommandExt::gid(&mut cmd, uid);
        }
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        self.child = Some(cmd.spawn().expect("spawn etcd-warden serve"));
    }

    /// Restarts the process with the same configuration.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// `http://<host>:<port><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}:{}{path}", self.host, self.port)
    }

    /// GET `path`: (status, JSON body or Null).
    pub async fn get(&self, path: &str) -> Option<(u16, serde_json::Value)> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .ok()?;
        let r = client.get(self.url(path)).send().await.ok()?;
        let code = r.status().as_u16();
        let text = r.text().await.ok()?;
        Some((
            code,
            serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)),
        ))
    }

    /// Waits until the HTTP server answers.
    pub async fn wait_up(&self) {
        let up = eventually(Duration::from_secs(20), || async {
            self.get("/livez").await.is_some()
        })
        .await;
        assert!(up, "etcd-warden did not start; log:\n{}", self.log_text());
    }

    /// Sends SIGTERM and waits up to `timeout` for a clean exit; returns the exit status.
    pub fn terminate(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let child = self.child.as_ref()?;
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        self.exit_within(timeout)
    }

    /// Waits up to `timeout` for the process to exit (on its own: a start-up failure); returns
    /// its exit status, or `None` (and kills it) when it is still running.
    pub fn exit_within(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        let start = std::time::Instant::now();
        while start.elapsed() < timeout {
            if let Ok(Some(s)) = child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        None
    }

    /// SIGKILL.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The running process's ID (for its RSS in `/proc`); `None` once killed.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(std::process::Child::id)
    }

    /// The log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Warden {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The indices of the sidecars whose `/status` says they are the snapshot leader.
pub async fn snapshot_leaders(wardens: &[Warden]) -> Vec<usize> {
    let mut out = Vec::new();
    for (i, w) in wardens.iter().enumerate() {
        if let Some((_, s)) = w.get("/status").await
            && s["snapshotter"]["leader"] == true
        {
            out.push(i);
        }
    }
    out
}
