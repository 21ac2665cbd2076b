//! Pods as real PID namespaces, as Kubernetes runs a pod with `shareProcessNamespace: true`.
//!
//! A pod is a "pause" process that is PID 1 of a new PID namespace with its own `/proc`
//! (`unshare --pid --fork --mount-proc --kill-child sleep infinity`); containers are processes
//! started inside it with `nsenter --target <pause> --pid --mount -- <command>`. So the sidecar
//! sees only its own pod in `/proc` and finds etcd by name alone (`kill.process_name = "etcd"`, no
//! command-line filter): the production configuration. Killing the pause process takes down
//! everything in the pod (the kernel kills a PID namespace with its init).
//!
//! `nsenter` forks (a PID namespace applies to children only), so the process that runs the
//! command is nsenter's child: [`PodProcess`] finds it by scanning `/proc` for nsenter's child
//! that has exec'd, and signals that process (checking its start time first), never nsenter.
//! nsenter waits for it and exits with its status, which is how the [`Kubelet`] sees a death.
//!
//! The pause process gets SIGKILL when the thread that started it exits (`setpriv --pdeathsig`
//! on `unshare`, and `--kill-child` from there): a test process that dies without running its
//! destructors leaves no pod behind. Start pods from the test's own thread or a runtime worker,
//! never from `spawn_blocking` (whose threads come and go).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_warden::etcd::process::{self, Bootstrap, ClusterState, MemberSpec};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio_util::sync::CancellationToken;

use super::etcd::Release;
use super::require_bin;

/// The fields of `/proc/<pid>/stat` the pods need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcStat {
    pub comm: String,
    pub state: char,
    pub ppid: i32,
    /// Clock ticks after boot (field 22): with the PID, identifies a process against PID reuse.
    pub start_time: u64,
}

/// Reads `/proc/<pid>/stat` (None when the process is gone).
pub fn proc_stat(pid: i32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text.get(open + 1..close)?.to_string();
    let fields: Vec<&str> = text.get(close + 1..)?.split_ascii_whitespace().collect();
    Some(ProcStat {
        comm,
        state: fields.first()?.chars().next()?,
        ppid: fields.get(1)?.parse().ok()?,
        start_time: fields.get(19)?.parse().ok()?,
    })
}

/// PIDs (in our namespace) of every process whose parent is `ppid`.
fn children_of(ppid: i32) -> Vec<(i32, ProcStat)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| Some((pid, proc_stat(pid)?)))
        .filter(|(_, s)| s.ppid == ppid)
        .collect()
}

/// The `/proc/<pid>/ns/pid` link of a process: equal links mean the same PID namespace.
pub fn pid_ns_of(pid: i32) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok()
}

fn util_linux(name: &str) -> PathBuf {
    require_bin(
        name,
        &[
            PathBuf::from(format!("/usr/bin/{name}")),
            PathBuf::from(format!("/bin/{name}")),
        ],
        "apt-get install util-linux",
    )
}

/// One pod: a pause process that is PID 1 of its own PID namespace (and mount namespace with its
/// own `/proc`). Dropping it kills everything inside.
pub struct PodNs {
    pub name: String,
    /// `setpriv … unshare …`: the pause process's parent.
    unshare: Child,
    /// The pause process, in our PID namespace.
    pause: i32,
    ns: PathBuf,
}

impl PodNs {
    /// Starts an empty pod.
    pub fn start(name: &str) -> PodNs {
        let mut unshare = Command::new(util_linux("setpriv"))
            .args(["--pdeathsig", "KILL", "--"])
            .arg(util_linux("unshare"))
            .args(["--pid", "--fork", "--mount-proc", "--kill-child", "--"])
            .args(["sleep", "infinity"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn unshare");
        let parent = unshare.id() as i32;
        let own = pid_ns_of(std::process::id() as i32);
        let start = Instant::now();
        // The pause process has exec'd `sleep` once /proc is mounted in its namespace.
        let pause = loop {
            let found = children_of(parent)
                .into_iter()
                .find(|(pid, s)| s.comm == "sleep" && pid_ns_of(*pid) != own);
            if let Some((pid, _)) = found {
                break pid;
            }
            if let Ok(Some(status)) = unshare.try_wait() {
                panic!("unshare exited with {status} (are PID namespaces allowed here?)");
            }
            if start.elapsed() > Duration::from_secs(10) {
                let _ = unshare.kill();
                let _ = unshare.wait();
                panic!("pod {name}: no pause process after 10 s");
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let ns = pid_ns_of(pause).expect("the pause process's PID namespace");
        PodNs {
            name: name.to_string(),
            unshare,
            pause,
            ns,
        }
    }

    /// The pause process's PID in our namespace.
    pub fn pause_pid(&self) -> i32 {
        self.pause
    }

    /// Whether the pod's init is still there.
    pub fn is_alive(&self) -> bool {
        proc_stat(self.pause).is_some_and(|s| s.state != 'Z')
            && pid_ns_of(self.pause).as_ref() == Some(&self.ns)
    }

    /// Host PIDs of every process in the pod, the pause process included.
    pub fn processes(&self) -> Vec<i32> {
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| pid_ns_of(*pid).as_ref() == Some(&self.ns))
            .collect()
    }

    /// Starts `cmd` inside the pod (program, arguments, environment and working directory of
    /// `cmd`; its stdio is replaced: output appended to `log`).
    pub fn spawn(&self, cmd: &Command, log: &Path) -> PodProcess {
        let mut n = Command::new(util_linux("nsenter"));
        n.arg("--target")
            .arg(self.pause.to_string())
            .args(["--pid", "--mount", "--"]);
        let mut n = wrapping(n, cmd);
        let out = std::fs::File::options()
            .create(true)
            .append(true)
            .open(log)
            .expect("open container log");
        n.stdin(Stdio::null())
            .stdout(out.try_clone().expect("clone log handle"))
            .stderr(out);
        let mut nsenter = n.spawn().expect("spawn nsenter");
        let program: OsString = cmd.get_program().into();
        let target = find_exec_child(&mut nsenter);
        PodProcess {
            program,
            nsenter,
            target,
            started: Instant::now(),
        }
    }

    /// SIGKILL to the pause process: everything in the pod dies with it.
    pub fn kill(&mut self) {
        if self.is_alive() {
            let _ = kill(Pid::from_raw(self.pause), Signal::SIGKILL);
        }
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.unshare.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.unshare.kill();
        let _ = self.unshare.wait();
    }
}

impl Drop for PodNs {
    fn drop(&mut self) {
        self.kill();
    }
}

/// nsenter's child once it has exec'd the command: (PID, start time). None if it is already gone.
fn find_exec_child(nsenter: &mut Child) -> Option<(i32, u64)> {
    let parent = nsenter.id() as i32;
    let start = Instant::now();
    loop {
        // Before its exec the child still carries nsenter's name.
        if let Some((pid, s)) = children_of(parent)
            .into_iter()
            .find(|(_, s)| s.comm != "nsenter")
        {
            return Some((pid, s.start_time));
        }
        if let Ok(Some(_)) = nsenter.try_wait() {
            return None;
        }
        if start.elapsed() > Duration::from_secs(10) {
            // Still not exec'd: signal whatever child there is (its start time identifies it).
            return children_of(parent)
                .into_iter()
                .next()
                .map(|(pid, s)| (pid, s.start_time));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A process running inside a pod.
pub struct PodProcess {
    program: OsString,
    nsenter: Child,
    /// The process itself (host PID, start time).
    target: Option<(i32, u64)>,
    pub started: Instant,
}

impl PodProcess {
    /// Its PID in our namespace, while it runs.
    pub fn pid(&self) -> Option<i32> {
        self.target
            .filter(|(pid, t)| proc_stat(*pid).is_some_and(|s| s.start_time == *t))
            .map(|(pid, _)| pid)
    }

    /// Continues the process after a SIGSTOP, and nsenter too: nsenter waits for it with
    /// `WUNTRACED` and stops itself when its child stops, so a SIGCONT to the process alone
    /// leaves nsenter stopped, never reaping it (the kubelet then never sees it die).
    pub fn resume(&self) -> bool {
        let ok = self.signal(Signal::SIGCONT);
        let _ = kill(Pid::from_raw(self.nsenter.id() as i32), Signal::SIGCONT);
        ok
    }

    /// Sends `signal` to the process itself (not nsenter); false when it is gone.
    pub fn signal(&self, signal: Signal) -> bool {
        match self.pid() {
            Some(pid) => kill(Pid::from_raw(pid), signal).is_ok(),
            None => false,
        }
    }

    /// Its exit status once it has exited (nsenter exits with it).
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        self.nsenter.try_wait().ok().flatten()
    }

    /// Whether it still runs.
    pub fn is_running(&mut self) -> bool {
        self.try_exit().is_none()
    }

    /// SIGKILL and wait for it.
    pub fn kill(&mut self) -> Option<ExitStatus> {
        self.signal(Signal::SIGKILL);
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5) {
            if let Some(s) = self.try_exit() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = self.nsenter.kill();
        self.nsenter.wait().ok()
    }

    /// The program it runs.
    pub fn program(&self) -> &OsString {
        &self.program
    }
}

impl Drop for PodProcess {
    fn drop(&mut self) {
        if self.is_running() {
            self.kill();
        }
    }
}

/// The specs of an `n`-member etcd cluster (`m0`, `m1`, …) on ports chosen by the library
/// (`etcd::process::pick_port`), data directories under `dir`. Their ports are fixed: the kubelet
/// restarts a member on the same ones.
pub fn member_specs(n: usize, dir: &Path, token: &str) -> Vec<MemberSpec> {
    let mut specs: Vec<MemberSpec> = (0..n)
        .map(|i| {
            let mut spec = MemberSpec {
                no_fsync: true,
                log_level: "warn".into(),
                ..MemberSpec::new(format!("m{i}"), dir.join(format!("m{i}.etcd")))
            };
            spec.choose_ports().expect("ports for an etcd member");
            spec
        })
        .collect();
    let initial_cluster = process::initial_cluster(&specs);
    for spec in &mut specs {
        spec.bootstrap = Some(Bootstrap {
            initial_cluster: Some(initial_cluster.clone()),
            state: ClusterState::New,
            token: token.to_string(),
        });
    }
    specs
}

/// The command line of one etcd member: the library's launcher ([`MemberSpec::command`], with
/// `--unsafe-no-fsync` where the release has it: the tests kill processes, not machines), which a
/// pod wraps in `nsenter`. The one place the pods build it.
pub fn etcd_command(spec: &MemberSpec, release: Release) -> Command {
    spec.command(release.binaries())
}

/// Why a container's process ended, as the kubelet saw it.
#[derive(Debug, Clone)]
pub struct Exit {
    pub container: String,
    pub incarnation: u32,
    pub status: String,
    /// The harness killed it on purpose.
    pub expected: bool,
    pub after: Duration,
}

/// One container of a pod: how to start it and what became of its processes.
pub struct Container {
    pub name: String,
    command: Box<dyn Fn() -> Command + Send>,
    pub log: PathBuf,
    process: Option<PodProcess>,
    /// Bumped on every start; readers use it to tell one process from the next.
    pub incarnation: Arc<AtomicU32>,
    /// Starts after the first one.
    pub restarts: u32,
    expected_exit: bool,
    dead_since: Option<Instant>,
    /// No restart before this instant (a harness-chosen down time).
    hold_until: Option<Instant>,
    /// Killed for good: the kubelet never starts it again.
    pub buried: bool,
    pub exits: Vec<Exit>,
}

/// A pod with its containers, restarted by the [`Kubelet`].
pub struct Pod {
    pub ns: PodNs,
    pub containers: Vec<Container>,
}

impl Pod {
    /// An empty pod named `name`.
    pub fn new(name: &str) -> Pod {
        Pod {
            ns: PodNs::start(name),
            containers: Vec::new(),
        }
    }

    /// Adds a container (not started yet) and returns its index.
    pub fn add(
        &mut self,
        name: &str,
        log: PathBuf,
        command: impl Fn() -> Command + Send + 'static,
    ) -> usize {
        self.containers.push(Container {
            name: name.to_string(),
            command: Box::new(command),
            log,
            process: None,
            incarnation: Arc::new(AtomicU32::new(0)),
            restarts: 0,
            expected_exit: false,
            dead_since: None,
            hold_until: None,
            buried: false,
            exits: Vec::new(),
        });
        self.containers.len() - 1
    }

    /// Starts container `c` (it must not be running).
    pub fn start(&mut self, c: usize) {
        let ns = &self.ns;
        let container = &mut self.containers[c];
        assert!(
            container.process.is_none(),
            "{} already running",
            container.name
        );
        let cmd = (container.command)();
        if container.incarnation.load(Ordering::SeqCst) > 0 {
            container.restarts += 1;
        }
        container.process = Some(ns.spawn(&cmd, &container.log));
        container.incarnation.fetch_add(1, Ordering::SeqCst);
        container.dead_since = None;
        container.expected_exit = false;
    }

    /// SIGKILLs container `c` on purpose; the kubelet starts it again after `hold` (or its usual
    /// delay, whichever is later). False when it was not running.
    pub fn kill(&mut self, c: usize, hold: Duration) -> bool {
        let container = &mut self.containers[c];
        container.hold_until = Some(Instant::now() + hold);
        match container.process.as_mut() {
            Some(p) => {
                let running = p.is_running();
                if running {
                    container.expected_exit = true;
                    p.signal(Signal::SIGKILL);
                }
                running
            }
            None => false,
        }
    }

    /// SIGKILLs container `c` for good (its machine is gone): the kubelet never starts it again.
    /// False when it was not running.
    pub fn bury(&mut self, c: usize) -> bool {
        self.containers[c].buried = true;
        self.kill(c, Duration::ZERO)
    }

    /// The running process of container `c`.
    pub fn process(&mut self, c: usize) -> Option<&mut PodProcess> {
        let p = self.containers[c].process.as_mut()?;
        if p.try_exit().is_none() {
            Some(p)
        } else {
            None
        }
    }

    /// One kubelet pass: notes exits, starts dead containers again once `delay` has passed.
    pub fn sync(&mut self, delay: Duration) {
        for c in 0..self.containers.len() {
            let container = &mut self.containers[c];
            if let Some(p) = container.process.as_mut()
                && let Some(status) = p.try_exit()
            {
                container.exits.push(Exit {
                    container: container.name.clone(),
                    incarnation: container.incarnation.load(Ordering::SeqCst),
                    status: status.to_string(),
                    expected: container.expected_exit,
                    after: p.started.elapsed(),
                });
                container.process = None;
                container.dead_since = Some(Instant::now());
            }
            let due = !container.buried
                && container.dead_since.is_some_and(|t| t.elapsed() >= delay)
                && container.hold_until.is_none_or(|t| Instant::now() >= t);
            if due {
                container.hold_until = None;
                self.start(c);
            }
        }
    }
}

/// A kubelet for a set of pods: every 25 ms, restarts (after `delay`) whatever container died.
pub struct Kubelet {
    pub pods: Arc<Mutex<Vec<Pod>>>,
    stop: CancellationToken,
}

impl Kubelet {
    /// Takes over `pods` and starts restarting their dead containers. Containers never started
    /// are left alone.
    pub fn start(pods: Vec<Pod>, delay: Duration) -> Kubelet {
        let pods = Arc::new(Mutex::new(pods));
        let stop = CancellationToken::new();
        let (p, s) = (pods.clone(), stop.clone());
        tokio::spawn(async move {
            while !s.is_cancelled() {
                {
                    let mut pods = p.lock().unwrap_or_else(|e| e.into_inner());
                    for pod in pods.iter_mut() {
                        pod.sync(delay);
                    }
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        });
        Kubelet { pods, stop }
    }

    /// Runs `f` on pod `i` under the lock.
    pub fn with_pod<T>(&self, i: usize, f: impl FnOnce(&mut Pod) -> T) -> T {
        let mut pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut pods[i])
    }

    /// Stops restarting containers (they keep running until the pods are dropped).
    pub fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.stop.cancel();
        // The pods die with their pause processes when the last reference goes; take them now so
        // that happens here, not in a task that may never run again.
        let pods = std::mem::take(&mut *self.pods.lock().unwrap_or_else(|e| e.into_inner()));
        drop(pods);
    }
}

/// `wrapper` (a program that execs the rest of its arguments, such as nsenter or setpriv) with
/// `cmd`'s program and arguments after its own, and `cmd`'s environment and working directory.
pub fn wrapping(mut wrapper: Command, cmd: &Command) -> Command {
    wrapper.arg(cmd.get_program()).args(cmd.get_args());
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => wrapper.env(k, v),
            None => wrapper.env_remove(k),
        };
    }
    if let Some(dir) = cmd.get_current_dir() {
        wrapper.current_dir(dir);
    }
    wrapper
}
