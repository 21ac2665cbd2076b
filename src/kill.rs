//! Finding and killing etcd in the shared PID namespace.
//!
//! Candidates are found by their name (`/proc/<pid>/comm`, which the kernel truncates to 15
//! bytes) and, when configured, a substring of their command line (`/proc/<pid>/cmdline`,
//! arguments joined by spaces). The sidecar's own process never matches, nor do zombies (already
//! dead, only waiting for their parent).
//!
//! Name and command line are anyone's to choose, so a candidate is only taken for etcd as
//! [`select`] says: those that hold the listening socket of a client port of `[etcd].endpoints`
//! in this sidecar's network namespace (`/proc/net/tcp{,6}` ↔ `/proc/<pid>/fd` →
//! `socket:[inode]`) or have the data directory's database open are etcd, and the others are
//! not; when none does (etcd starting, or gone), the candidates are taken by name, except,
//! once etcd was identified that way, those of another UID than etcd's. A decoy named `etcd`
//! (another user, its command line copied) therefore keeps neither the sidecar from seeing
//! etcd nor a kill from being verified once etcd is gone, and a restarted etcd that does not
//! listen yet is still killed.
//!
//! Stopping is SIGTERM, up to `grace` for the process to go, then SIGKILL. A PID can be reused by
//! an unrelated process once etcd is gone, so every signal is preceded by re-reading the process's
//! start time (`/proc/<pid>/stat` field 22) and is only sent when it still matches the one seen
//! when the process was found. (nix 0.31 offers no pidfd API without `unsafe`, which this crate
//! forbids; the remaining window between that read and the signal is microseconds, while PID reuse
//! needs the whole PID space to wrap.)
//!
//! A kill counts only when it is **verified** ([`KillReport::verified`]): at least one etcd process
//! was found (now or by an earlier attempt of the same kill) and every one of them is gone. No
//! process found, a signal refused (EPERM: another UID without CAP_KILL), or a process still there
//! after SIGKILL is a kill that did not happen, and the caller retries it. [`ProcessControl::probe`]
//! answers beforehand whether etcd is visible and may be signalled (signal 0), so a sidecar that
//! could not kill etcd is never trusted with it.

use std::fmt;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::config::KillConfig;

/// The longest a process name can be in `/proc/<pid>/comm` (TASK_COMM_LEN - 1).
const COMM_LEN: usize = 15;

/// How long to wait for a process to disappear after SIGKILL before reporting it still alive.
const AFTER_SIGKILL: Duration = Duration::from_secs(5);

/// Why etcd cannot be seen, signalled or listed.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// No live process matches.
    #[error(
        "no etcd process matches kill.process_name = {name:?}{cmdline}: is the PID namespace shared (shareProcessNamespace: true) and the name right?{ignored}"
    )]
    NotFound {
        /// The configured name.
        name: String,
        /// `, kill.cmdline_contains = "…"` or empty.
        cmdline: String,
        /// ` Not taken for etcd: …` (processes of that name that are not it, and why), or empty.
        ignored: String,
    },
    /// The proc filesystem could not be listed.
    #[error("cannot list {path}: {source}")]
    ListProc {
        /// The directory listed.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// The signal-0 probe was refused: a kill would be too.
    #[error("etcd (pid {pid}) may not be signalled: {source}{hint}", hint = permission_hint(*source))]
    NotPermitted {
        /// The process.
        pid: i32,
        /// Why.
        source: nix::Error,
    },
    /// A signal could not be sent for a reason other than the process being gone.
    #[error("cannot send {signal} to etcd (pid {pid}): {source}{hint}", hint = permission_hint(*source))]
    Signal {
        /// The target.
        pid: i32,
        /// The signal.
        signal: Signal,
        /// The error.
        source: nix::Error,
    },
}

fn permission_hint(e: nix::Error) -> &'static str {
    if e == nix::Error::EPERM {
        " (run the sidecar as etcd's UID, or give it CAP_KILL)"
    } else {
        ""
    }
}

/// Which processes are etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matcher {
    /// Compared with `/proc/<pid>/comm` (truncated like the kernel does); empty matches any name.
    pub name: String,
    /// When set, `/proc/<pid>/cmdline` (arguments joined by spaces) must contain it.
    pub cmdline_contains: Option<String>,
}

impl Matcher {
    /// Whether a process with this `comm` and `cmdline` (NUL-separated, as in /proc) is etcd.
    pub fn matches(&self, comm: &str, cmdline: &[u8]) -> bool {
        let name_ok = self.name.is_empty() || comm == truncate_comm(&self.name);
        let cmdline_ok = match &self.cmdline_contains {
            None => true,
            Some(needle) => {
                let joined = cmdline_text(cmdline);
                joined.contains(needle.as_str())
            }
        };
        name_ok && cmdline_ok
    }
}

/// The kernel keeps the first 15 bytes of a process name; compare on what it keeps.
fn truncate_comm(name: &str) -> &str {
    if name.len() <= COMM_LEN {
        return name;
    }
    let mut end = COMM_LEN;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

/// `/proc/<pid>/cmdline` as text: NUL-separated arguments joined by spaces.
fn cmdline_text(raw: &[u8]) -> String {
    let trimmed = raw.strip_suffix(&[0]).unwrap_or(raw);
    String::from_utf8_lossy(trimmed).replace('\0', " ")
}

/// The fields of `/proc/<pid>/stat` this module needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stat {
    /// The process name (field 2, without parentheses).
    pub comm: String,
    /// The state letter (field 3): `R`, `S`, `D`, `Z`, ...
    pub state: char,
    /// Start time after boot in clock ticks (field 22).
    pub start_time: u64,
}

impl Stat {
    /// Parses `/proc/<pid>/stat`. The name may contain spaces and parentheses, so the fields
    /// after it are found from the last `)`.
    pub fn parse(text: &str) -> Option<Stat> {
        let open = text.find('(')?;
        let close = text.rfind(')')?;
        let comm = text.get(open + 1..close)?.to_string();
        let mut rest = text.get(close + 1..)?.split_ascii_whitespace();
        let state = rest.next()?.chars().next()?;
        // `rest` now starts at field 4; field 22 is 18 further.
        let start_time = rest.nth(18)?.parse().ok()?;
        Some(Stat {
            comm,
            state,
            start_time,
        })
    }

    /// Dead (zombie or exiting): signals do nothing, and the process is as good as gone.
    pub fn is_dead(&self) -> bool {
        matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// A process as found: its PID and the start time that identifies it against PID reuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ProcessId {
    /// The PID in the shared namespace.
    pub pid: i32,
    /// Start time after boot in clock ticks (`/proc/<pid>/stat` field 22).
    pub start_time: u64,
}

impl fmt::Display for ProcessId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid {} (started at tick {})", self.pid, self.start_time)
    }
}

/// What ties a process named like etcd to the etcd this sidecar guards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Evidence {
    /// It holds the listening socket of this client port in the sidecar's network namespace.
    ClientPort(u16),
    /// It has the data directory's database (`member/snap/db`) open.
    Database,
}

impl fmt::Display for Evidence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Evidence::ClientPort(port) => write!(f, "client port {port} listener"),
            Evidence::Database => f.write_str("data directory's database open"),
        }
    }
}

/// A process named like etcd, as examined by [`ProcKiller::find`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The process.
    pub process: ProcessId,
    /// Its real UID (`/proc/<pid>/status`), when readable.
    pub uid: Option<u32>,
    /// What ties it to etcd; empty when nothing does (or its descriptors could not be read:
    /// another user's, to a sidecar that is not root).
    pub evidence: Vec<Evidence>,
}

/// Which candidates are etcd, and how that was told.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    /// The processes taken for etcd.
    pub chosen: Vec<ProcessId>,
    /// How, in words (`client port 2379 listener`, or `name only: …`); empty when none.
    pub identified_by: String,
    /// Candidates not taken for etcd, each with why.
    pub ignored: Vec<(ProcessId, String)>,
    /// The UID of the processes identified by evidence, when they share one.
    pub uid: Option<u32>,
}

/// Chooses etcd among `candidates`: those with evidence when any has some. Otherwise, once etcd
/// was identified by evidence as running as `known_uid`, those of that UID (a restarted etcd
/// that does not listen yet is still etcd, a decoy of another user is not, and so no longer
/// keeps the sidecar from seeing etcd nor a kill from being verified once etcd is gone); before
/// that, every candidate (failing closed: a process that may be etcd is never left out, and one
/// this sidecar may not signal is reported as such).
pub fn select(candidates: Vec<Candidate>, known_uid: Option<u32>) -> Selection {
    let mut selection = Selection::default();
    let identified = candidates.iter().any(|c| !c.evidence.is_empty());
    let mut how: Vec<String> = Vec::new();
    let mut uids = std::collections::BTreeSet::new();
    let shown = |uid: Option<u32>| uid.map_or_else(|| "?".to_string(), |u| u.to_string());
    for c in candidates {
        let take = if identified {
            !c.evidence.is_empty()
        } else {
            known_uid.is_none() || c.uid == known_uid
        };
        if !take {
            let why = match (identified, known_uid) {
                (true, _) => {
                    "neither listens on a client port nor has the database open, while another does"
                        .to_string()
                }
                (false, known) => format!(
                    "uid {}, not the uid {} etcd was identified with",
                    shown(c.uid),
                    shown(known)
                ),
            };
            selection.ignored.push((c.process, why));
            continue;
        }
        for e in &c.evidence {
            let e = e.to_string();
            if !how.contains(&e) {
                how.push(e);
            }
        }
        if identified {
            uids.insert(c.uid);
        }
        selection.chosen.push(c.process);
    }
    selection.chosen.sort_by_key(|p| p.pid);
    selection.identified_by = match (identified, known_uid, selection.chosen.is_empty()) {
        (_, _, true) => String::new(),
        (true, _, false) => how.join(", "),
        (false, Some(uid), false) => format!(
            "name and uid {uid} (etcd's when it was last identified); none listens on a client port or has the database open now"
        ),
        (false, None, false) => {
            "name only: no candidate listens on a client port or has the database open".to_string()
        }
    };
    if let [Some(uid)] = uids.into_iter().collect::<Vec<_>>().as_slice() {
        selection.uid = Some(*uid);
    }
    selection
}

/// The ports of etcd's client endpoints (`http://127.0.0.1:2379`, `host:2379`), those named.
pub fn client_ports(endpoints: &[String]) -> Vec<u16> {
    let mut ports = Vec::new();
    for e in endpoints {
        let parsed = url::Url::parse(e)
            .ok()
            .filter(|u| u.has_host())
            .or_else(|| url::Url::parse(&format!("http://{e}")).ok());
        if let Some(port) = parsed.and_then(|u| u.port_or_known_default())
            && !ports.contains(&port)
        {
            ports.push(port);
        }
    }
    ports
}

/// What the last search found out, kept across searches.
#[derive(Debug, Default)]
struct Memory {
    /// The UID etcd was last identified with by evidence.
    uid: Option<u32>,
    /// How the last search told etcd.
    identified_by: Option<String>,
}

/// What a signal attempt did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signalled {
    /// The signal was sent to the process found earlier.
    Sent,
    /// The process is gone (or dead); nothing was sent.
    Gone,
    /// The PID now belongs to another process (start time differs); nothing was sent.
    Reused,
}

/// How one etcd process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// It exited within the grace after SIGTERM.
    Terminated,
    /// It was still there after the grace and got SIGKILL, then went away.
    Killed,
    /// It went away (or its PID was reused) before we signalled it.
    Vanished,
    /// Still there after SIGKILL (uninterruptible sleep?); the kill is tried again.
    StillAlive,
    /// A signal was refused (EPERM: another UID without CAP_KILL); the kill is tried again.
    Refused {
        /// The signal refused.
        signal: Signal,
        /// Why.
        errno: nix::Error,
    },
}

impl Outcome {
    /// The process is gone.
    pub fn is_gone(&self) -> bool {
        matches!(
            self,
            Outcome::Terminated | Outcome::Killed | Outcome::Vanished
        )
    }

    /// A bounded label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Terminated => "terminated",
            Outcome::Killed => "killed",
            Outcome::Vanished => "vanished",
            Outcome::StillAlive => "still_alive",
            Outcome::Refused { .. } => "refused",
        }
    }
}

/// What a kill did, per process found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KillReport {
    /// Every matching process (and every one an earlier attempt of the same kill had found) and
    /// how it ended; empty when none was ever found.
    pub processes: Vec<(ProcessId, Outcome)>,
}

impl KillReport {
    /// No matching process was found.
    pub fn not_found(&self) -> bool {
        self.processes.is_empty()
    }

    /// The kill happened: a process was found and every one found is gone.
    pub fn verified(&self) -> bool {
        !self.processes.is_empty() && self.processes.iter().all(|(_, o)| o.is_gone())
    }

    /// Why the kill is not verified, in words; `None` when it is.
    pub fn failure(&self) -> Option<String> {
        if self.verified() {
            return None;
        }
        if self.processes.is_empty() {
            return Some("no etcd process found".into());
        }
        let left: Vec<String> = self
            .processes
            .iter()
            .filter(|(_, o)| !o.is_gone())
            .map(|(p, o)| match o {
                Outcome::Refused { signal, errno } => {
                    format!("{p}: {signal} refused: {errno}{}", permission_hint(*errno))
                }
                _ => format!("{p}: still alive after SIGKILL"),
            })
            .collect();
        Some(left.join("; "))
    }

    /// How many signals of each kind were sent: (SIGTERM, SIGKILL).
    pub fn signals_sent(&self) -> (usize, usize) {
        let terms = self
            .processes
            .iter()
            .filter(|(_, o)| {
                !matches!(
                    o,
                    Outcome::Vanished
                        | Outcome::Refused {
                            signal: Signal::SIGTERM,
                            ..
                        }
                )
            })
            .count();
        let kills = self
            .processes
            .iter()
            .filter(|(_, o)| matches!(o, Outcome::Killed | Outcome::StillAlive))
            .count();
        (terms, kills)
    }
}

/// Seeing and stopping etcd; the I/O seam the ownership watchdog uses.
#[async_trait::async_trait]
pub trait ProcessControl: Send + Sync {
    /// The etcd processes, each checked with signal 0: an error when none is found or one may
    /// not be signalled.
    async fn probe(&self) -> Result<Vec<ProcessId>, ProcessError>;

    /// SIGTERM every etcd process, SIGKILL those still there after the grace, and report how each
    /// ended. `earlier` are the processes earlier attempts of the same kill found: they are
    /// included in the report (gone, or stopped again), so a retry after the process went away
    /// on its own still verifies. An error only when the process table cannot be read.
    async fn kill_etcd(&self, earlier: &[ProcessId]) -> Result<KillReport, ProcessError>;

    /// How the processes the last search returned were told from others of their name, for
    /// `/status`; `None` when not known.
    fn identified_by(&self) -> Option<String> {
        None
    }
}

/// Finds and signals processes through a proc filesystem.
#[derive(Debug, Clone)]
pub struct ProcKiller {
    proc_root: PathBuf,
    matcher: Matcher,
    grace: Duration,
    poll: Duration,
    client_ports: Vec<u16>,
    data_dir: Option<PathBuf>,
    memory: std::sync::Arc<std::sync::Mutex<Memory>>,
}

impl ProcKiller {
    /// A killer for the configured etcd process, looking in `/proc`.
    pub fn new(config: &KillConfig) -> Self {
        ProcKiller {
            proc_root: PathBuf::from("/proc"),
            matcher: Matcher {
                name: config.process_name.clone(),
                cmdline_contains: config.cmdline_contains.clone(),
            },
            grace: config.grace,
            poll: Duration::from_millis(100),
            client_ports: Vec::new(),
            data_dir: None,
            memory: Default::default(),
        }
    }

    /// Tells etcd from other processes of its name by the listener of one of these client
    /// ports (those of `[etcd].endpoints`).
    pub fn with_client_ports(mut self, ports: Vec<u16>) -> Self {
        self.client_ports = ports;
        self
    }

    /// Tells etcd from other processes of its name by its database, open under `data_dir`.
    pub fn with_data_dir(mut self, data_dir: Option<PathBuf>) -> Self {
        self.data_dir = data_dir;
        self
    }

    /// How the processes the last search returned were told from others of their name.
    pub fn identified_by(&self) -> Option<String> {
        self.memory.lock().ok()?.identified_by.clone()
    }

    /// Looks in another proc filesystem (tests, or a host `/proc` mounted elsewhere).
    pub fn with_proc_root(mut self, root: impl Into<PathBuf>) -> Self {
        self.proc_root = root.into();
        self
    }

    /// The processes taken for etcd ([`select`] over [`ProcKiller::candidates`]).
    pub fn find(&self) -> Result<Vec<ProcessId>, ProcessError> {
        Ok(self.search()?.chosen)
    }

    /// [`ProcKiller::find`] with what was ignored and why; remembers how etcd was told.
    pub fn search(&self) -> Result<Selection, ProcessError> {
        let named = self.candidates()?;
        let listeners = if named.is_empty() || self.client_ports.is_empty() {
            Default::default()
        } else {
            self.listeners()
        };
        let database = self
            .data_dir
            .as_ref()
            .and_then(|d| std::fs::metadata(d.join("member/snap/db")).ok())
            .map(|m| (m.dev(), m.ino()));
        let mut examined = Vec::new();
        for process in named {
            let dir = self.proc_root.join(process.pid.to_string());
            examined.push(Candidate {
                process,
                uid: read_uid(&dir),
                evidence: evidence(&dir, &listeners, database),
            });
        }
        let mut memory = self
            .memory
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let selection = select(examined, memory.uid);
        if selection.uid.is_some() {
            memory.uid = selection.uid;
        }
        memory.identified_by =
            (!selection.identified_by.is_empty()).then(|| selection.identified_by.clone());
        drop(memory);
        for (p, why) in &selection.ignored {
            tracing::debug!(pid = p.pid, why = %why, "a process named like etcd is not taken for it");
        }
        Ok(selection)
    }

    /// Listening TCP sockets on a client port in this process's network namespace: inode →
    /// port. Unreadable tables count as none (then no candidate is told by its port).
    fn listeners(&self) -> std::collections::HashMap<u64, u16> {
        let mut found = std::collections::HashMap::new();
        for table in ["tcp", "tcp6"] {
            let Ok(text) = std::fs::read_to_string(self.proc_root.join("net").join(table)) else {
                continue;
            };
            for (inode, port) in parse_listeners(&text) {
                if self.client_ports.contains(&port) {
                    found.insert(inode, port);
                }
            }
        }
        found
    }

    /// Every live process whose name and command line match, except this one.
    pub fn candidates(&self) -> Result<Vec<ProcessId>, ProcessError> {
        let entries =
            std::fs::read_dir(&self.proc_root).map_err(|source| ProcessError::ListProc {
                path: self.proc_root.clone(),
                source,
            })?;
        let own = std::process::id();
        let mut found = Vec::new();
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            if pid == own {
                continue;
            }
            // A process can exit between listing and reading: skip it, it is not etcd anymore.
            let dir = entry.path();
            let Some(stat) = read_stat(&dir) else {
                continue;
            };
            if stat.is_dead() {
                continue;
            }
            let comm = std::fs::read_to_string(dir.join("comm"))
                .map(|c| c.trim_end_matches('\n').to_string())
                .unwrap_or(stat.comm);
            let cmdline = if self.matcher.cmdline_contains.is_some() {
                std::fs::read(dir.join("cmdline")).unwrap_or_default()
            } else {
                Vec::new()
            };
            if self.matcher.matches(&comm, &cmdline)
                && let Ok(pid) = i32::try_from(pid)
            {
                found.push(ProcessId {
                    pid,
                    start_time: stat.start_time,
                });
            }
        }
        found.sort_by_key(|p| p.pid);
        Ok(found)
    }

    /// Sends `signal` to `process` only if its PID still names the process found earlier.
    pub fn signal(&self, process: ProcessId, signal: Signal) -> Result<Signalled, ProcessError> {
        match self.identity(process) {
            Signalled::Sent => {}
            other => return Ok(other),
        }
        match kill(Pid::from_raw(process.pid), signal) {
            Ok(()) => Ok(Signalled::Sent),
            Err(nix::Error::ESRCH) => Ok(Signalled::Gone),
            Err(source) => Err(ProcessError::Signal {
                pid: process.pid,
                signal,
                source,
            }),
        }
    }

    /// `Sent` when the PID still names `process` and it is alive, else why not.
    fn identity(&self, process: ProcessId) -> Signalled {
        match read_stat(&self.proc_root.join(process.pid.to_string())) {
            None => Signalled::Gone,
            Some(stat) if stat.start_time != process.start_time => Signalled::Reused,
            Some(stat) if stat.is_dead() => Signalled::Gone,
            Some(_) => Signalled::Sent,
        }
    }

    /// Waits up to `limit` for `process` to go; true when it went.
    async fn wait_gone(&self, process: ProcessId, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if self.identity(process) != Signalled::Sent {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(self.poll).await;
        }
    }

    /// SIGTERM, wait the grace, SIGKILL if still there; a refused signal is an outcome.
    pub async fn stop(&self, process: ProcessId) -> Outcome {
        match self.signal(process, Signal::SIGTERM) {
            Ok(Signalled::Sent) => {}
            Ok(_) => return Outcome::Vanished,
            Err(e) => return refused(e, Signal::SIGTERM),
        }
        tracing::info!(pid = process.pid, "sent SIGTERM to etcd");
        if self.wait_gone(process, self.grace).await {
            return Outcome::Terminated;
        }
        match self.signal(process, Signal::SIGKILL) {
            Ok(Signalled::Sent) => {}
            Ok(_) => return Outcome::Terminated,
            Err(e) => return refused(e, Signal::SIGKILL),
        }
        tracing::warn!(pid = process.pid, grace = ?self.grace, "etcd outlived the grace; sent SIGKILL");
        if self.wait_gone(process, AFTER_SIGKILL).await {
            Outcome::Killed
        } else {
            Outcome::StillAlive
        }
    }

    fn not_found(&self, ignored: &[(ProcessId, String)]) -> ProcessError {
        let ignored = match ignored {
            [] => String::new(),
            some => format!(
                " Not taken for etcd: {}",
                some.iter()
                    .map(|(p, why)| format!("{p}: {why}"))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        };
        ProcessError::NotFound {
            ignored,
            name: self.matcher.name.clone(),
            cmdline: self
                .matcher
                .cmdline_contains
                .as_ref()
                .map(|c| format!(", kill.cmdline_contains = {c:?}"))
                .unwrap_or_default(),
        }
    }
}

fn refused(error: ProcessError, signal: Signal) -> Outcome {
    let errno = match error {
        ProcessError::Signal { source, .. } => source,
        _ => nix::Error::EINVAL,
    };
    Outcome::Refused { signal, errno }
}

#[async_trait::async_trait]
impl ProcessControl for ProcKiller {
    async fn probe(&self) -> Result<Vec<ProcessId>, ProcessError> {
        let selection = self.search()?;
        let found = selection.chosen;
        if found.is_empty() {
            return Err(self.not_found(&selection.ignored));
        }
        for p in &found {
            // Signal 0 checks permission and existence without signalling.
            match kill(Pid::from_raw(p.pid), None) {
                Ok(()) | Err(nix::Error::ESRCH) => {}
                Err(source) => return Err(ProcessError::NotPermitted { pid: p.pid, source }),
            }
        }
        Ok(found)
    }

    async fn kill_etcd(&self, earlier: &[ProcessId]) -> Result<KillReport, ProcessError> {
        let selection = self.search()?;
        let mut targets = selection.chosen;
        for p in earlier {
            if !targets.contains(p) {
                targets.push(*p);
            }
        }
        if targets.is_empty() {
            tracing::error!(error = %self.not_found(&selection.ignored), "cannot kill etcd");
        }
        // All at once, so several matches share one grace instead of adding theirs up. A process
        // an earlier attempt found and that is gone now reports Vanished.
        let stops = targets.iter().map(|p| self.stop(*p));
        let outcomes = futures::future::join_all(stops).await;
        Ok(KillReport {
            processes: targets.into_iter().zip(outcomes).collect(),
        })
    }

    fn identified_by(&self) -> Option<String> {
        ProcKiller::identified_by(self)
    }
}

/// The real UID of the process whose /proc directory is `dir` (`Uid:` in `status`).
fn read_uid(dir: &Path) -> Option<u32> {
    let status = std::fs::read_to_string(dir.join("status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_ascii_whitespace()
        .next()?
        .parse()
        .ok()
}

/// What ties the process whose /proc directory is `dir` to etcd: a descriptor on one of
/// `listeners` (inode → port), or on the file `database` (device, inode). Descriptors that
/// cannot be read (another UID's, to a sidecar that is not root) tie it to nothing.
fn evidence(
    dir: &Path,
    listeners: &std::collections::HashMap<u64, u16>,
    database: Option<(u64, u64)>,
) -> Vec<Evidence> {
    let mut found = Vec::new();
    let Ok(fds) = std::fs::read_dir(dir.join("fd")) else {
        return found;
    };
    for fd in fds.flatten() {
        let Ok(target) = std::fs::read_link(fd.path()) else {
            continue;
        };
        let target = target.as_os_str().to_string_lossy();
        let port = target
            .strip_prefix("socket:[")
            .and_then(|t| t.strip_suffix(']'))
            .and_then(|i| i.parse::<u64>().ok())
            .and_then(|inode| listeners.get(&inode));
        let e = match port {
            Some(port) => Evidence::ClientPort(*port),
            // The link names the file in etcd's own mount namespace; the file itself (followed
            // through the link) is compared, so the path etcd sees it under does not matter.
            None if database.is_some() && target.ends_with("/db") => {
                match std::fs::metadata(fd.path()) {
                    Ok(m) if Some((m.dev(), m.ino())) == database => Evidence::Database,
                    _ => continue,
                }
            }
            None => continue,
        };
        if !found.contains(&e) {
            found.push(e);
        }
        // etcd holds thousands of descriptors under load: stop once nothing more can be told.
        let port_seen =
            listeners.is_empty() || found.iter().any(|e| matches!(e, Evidence::ClientPort(_)));
        if port_seen && (database.is_none() || found.contains(&Evidence::Database)) {
            break;
        }
    }
    found
}

/// `/proc/net/tcp{,6}`: the (inode, local port) of each listening socket (state `0A`).
fn parse_listeners(table: &str) -> Vec<(u64, u16)> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_ascii_whitespace().collect();
            if fields.get(3) != Some(&"0A") {
                return None;
            }
            let port = fields.get(1)?.rsplit(':').next()?;
            let port = u16::from_str_radix(port, 16).ok()?;
            let inode = fields.get(9)?.parse().ok()?;
            Some((inode, port))
        })
        .collect()
}

fn read_stat(dir: &Path) -> Option<Stat> {
    std::fs::read_to_string(dir.join("stat"))
        .ok()
        .and_then(|text| Stat::parse(&text))
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "4242 (etcd) S 1 4242 4242 0 -1 4194560 1234 0 0 0 10 5 0 0 20 0 12 0 \
                        987654 123456789 2000 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0";

    #[test]
    fn stat_fields_are_read_after_the_name() {
        let stat = Stat::parse(STAT).expect("parses");
        assert_eq!(
            stat,
            Stat {
                comm: "etcd".into(),
                state: 'S',
                start_time: 987654
            }
        );
        let tricky = STAT.replace("(etcd)", "(e) t (c) d)");
        let stat = Stat::parse(&tricky).expect("parses");
        assert_eq!(stat.comm, "e) t (c) d");
        assert_eq!(stat.start_time, 987654);
    }

    #[test]
    fn broken_stat_is_none() {
        assert_eq!(Stat::parse(""), None);
        assert_eq!(Stat::parse("12 (x) S 1 2"), None);
        assert_eq!(Stat::parse("12 x S"), None);
    }

    #[test]
    fn zombies_are_dead() {
        let zombie = Stat::parse(&STAT.replace(") S ", ") Z ")).expect("parses");
        assert!(zombie.is_dead());
        assert!(!Stat::parse(STAT).expect("parses").is_dead());
    }

    fn matcher(name: impl Into<String>, cmdline_contains: Option<&str>) -> Matcher {
        Matcher {
            name: name.into(),
            cmdline_contains: cmdline_contains.map(String::from),
        }
    }

    #[test]
    fn name_and_cmdline_matching() {
        let by_name = matcher("etcd", None);
        assert!(by_name.matches("etcd", b""));
        assert!(!by_name.matches("etcd-warden", b"etcd-warden\0serve\0"));
        assert!(!by_name.matches("etc", b""));

        let with_cmdline = matcher("etcd", Some("--name main"));
        assert!(with_cmdline.matches("etcd", b"/usr/bin/etcd\0--name\0main\0"));
        assert!(!with_cmdline.matches("etcd", b"/usr/bin/etcd\0--name\0events\0"));

        let any_name = matcher("", Some("etcd --data-dir"));
        assert!(any_name.matches("whatever", b"etcd\0--data-dir\0/var/etcd\0"));
    }

    #[test]
    fn long_names_compare_as_the_kernel_truncates_them() {
        let m = matcher("etcd-main-member-0", None);
        assert!(m.matches("etcd-main-membe", b""));
        assert_eq!(truncate_comm("ééééééééé"), "ééééééé");
    }

    #[test]
    fn signals_counted_per_outcome() {
        let p = ProcessId {
            pid: 1,
            start_time: 1,
        };
        let report = KillReport {
            processes: vec![
                (p, Outcome::Terminated),
                (p, Outcome::Killed),
                (p, Outcome::Vanished),
            ],
        };
        assert_eq!(report.signals_sent(), (2, 1));
        assert!(!report.not_found());
        assert!(KillReport::default().not_found());
    }

    fn candidate(pid: i32, uid: u32, evidence: Vec<Evidence>) -> Candidate {
        Candidate {
            process: ProcessId { pid, start_time: 1 },
            uid: Some(uid),
            evidence,
        }
    }

    fn pids(selection: &Selection) -> Vec<i32> {
        selection.chosen.iter().map(|p| p.pid).collect()
    }

    /// The client port's listener (or the database's holder) is etcd, and a decoy beside it is
    /// not; once etcd is gone the decoy (another UID) still is not, by the UID etcd had, while a
    /// restarted etcd of that UID that does not listen yet is.
    #[test]
    fn evidence_picks_etcd_and_its_uid_outlasts_it() {
        let real = candidate(10, 65532, vec![Evidence::ClientPort(2379)]);
        let decoy = candidate(20, 1000, vec![]);
        let s = select(vec![decoy.clone(), real], None);
        assert_eq!(pids(&s), vec![10]);
        assert_eq!(s.identified_by, "client port 2379 listener");
        assert_eq!(s.uid, Some(65532));
        assert_eq!(s.ignored.len(), 1);
        assert_eq!(s.ignored[0].0.pid, 20);

        let s = select(vec![decoy.clone()], Some(65532));
        assert!(s.chosen.is_empty(), "{s:?}");
        assert!(s.ignored[0].1.contains("uid 1000"), "{:?}", s.ignored);
        let restarted = candidate(30, 65532, vec![]);
        let s = select(vec![decoy.clone(), restarted], Some(65532));
        assert_eq!(pids(&s), vec![30]);
        assert!(s.identified_by.contains("uid 65532"), "{}", s.identified_by);

        let db = candidate(40, 65532, vec![Evidence::Database]);
        let s = select(vec![db, candidate(50, 65532, vec![])], None);
        assert_eq!(pids(&s), vec![40]);
        assert_eq!(s.identified_by, "data directory's database open");
    }

    /// Never identified (etcd not listening yet, or its descriptors unreadable): every process
    /// of the name is taken, so a real etcd is never left out for want of evidence.
    #[test]
    fn without_evidence_every_candidate_counts() {
        let s = select(
            vec![candidate(20, 1000, vec![]), candidate(30, 65532, vec![])],
            None,
        );
        assert_eq!(pids(&s), vec![20, 30]);
        assert!(
            s.identified_by.starts_with("name only"),
            "{}",
            s.identified_by
        );
        assert!(select(vec![], None).identified_by.is_empty());
    }

    #[test]
    fn listeners_are_read_from_the_tcp_tables() {
        let tcp = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 0100007F:094B 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0000000000000000 100 0 0 10 0\n   1: 0100007F:094B 0100007F:D2C4 01 00000000:00000000 00:00000000 00000000     0        0 4343 1 0000000000000000 20 4 30 10 -1\n";
        assert_eq!(parse_listeners(tcp), vec![(4242, 2379)]);
        let tcp6 = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 00000000000000000000000000000000:0950 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 777 1 0000000000000000 100 0 0 10 0\n";
        assert_eq!(parse_listeners(tcp6), vec![(777, 2384)]);
    }

    #[test]
    fn client_ports_come_from_the_endpoints() {
        let endpoints = [
            "http://127.0.0.1:2379".to_string(),
            "https://etcd-main-local:2379".to_string(),
            "localhost:32379".to_string(),
            "https://etcd".to_string(),
        ];
        assert_eq!(client_ports(&endpoints), vec![2379, 32379, 443]);
    }
}
