//! Finding and stopping "etcd" with real processes: a copied `sleep` binary under a unique name.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use etcd_warden::config::KillConfig;
use etcd_warden::kill::{Outcome, ProcKiller, ProcessControl, ProcessId, Signalled};
use nix::sys::signal::Signal;
use tokio::process::{Child, Command};

/// A copy of `sleep` named `name` (≤ 15 bytes so /proc/<pid>/comm shows all of it).
struct FakeEtcd {
    _dir: tempfile::TempDir,
    binary: PathBuf,
}

fn sleep_binary() -> PathBuf {
    for candidate in ["/usr/bin/sleep", "/bin/sleep"] {
        let path = PathBuf::from(candidate);
        if path.exists() {
            return path;
        }
    }
    panic!("these tests need the `sleep` binary (Debian package coreutils) at /usr/bin/sleep");
}

impl FakeEtcd {
    fn new(tag: &str) -> FakeEtcd {
        let name = format!("wd{tag}{}", std::process::id() % 100_000);
        assert!(name.len() <= 15, "comm names are truncated at 15 bytes");
        let dir = tempfile::tempdir().expect("temp dir");
        let binary = dir.path().join(&name);
        std::fs::copy(sleep_binary(), &binary).expect("copy sleep");
        FakeEtcd { _dir: dir, binary }
    }

    fn name(&self) -> String {
        self.binary
            .file_name()
            .and_then(|n| n.to_str())
            .expect("name")
            .to_string()
    }

    fn spawn(&self, args: &[&str]) -> Child {
        // A freshly copied binary can be briefly "busy" (ETXTBSY) while another test thread's
        // fork still holds the copy's write descriptor; that passes within milliseconds.
        let mut tries = 0;
        loop {
            match Command::new(&self.binary)
                .args(args)
                .stdin(Stdio::null())
                .kill_on_drop(true)
                .spawn()
            {
                Ok(child) => return child,
                Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < 50 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("spawn fake etcd: {e:?}"),
            }
        }
    }
}

/// The fake etcd under a shell that makes it ignore SIGTERM, its command line carrying `marker`;
/// retried while the exec fails on a copy another thread's fork still holds open (ETXTBSY).
async fn spawn_ignoring_sigterm(fake: &FakeEtcd, marker: &str) -> Child {
    let script = format!("trap '' TERM; exec {} 30 {marker}", fake.binary.display());
    let finder = killer(&fake.name(), Some(marker), Duration::from_millis(100));
    for _ in 0..50 {
        let mut child = Command::new("sh")
            .args(["-c", &script])
            .kill_on_drop(true)
            .spawn()
            .expect("spawn sh");
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(2) {
            if !finder.find().expect("find").is_empty() {
                return child;
            }
            if child.try_wait().expect("try_wait").is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = child.kill().await;
    }
    panic!("the fake etcd never started");
}

fn killer(name: &str, cmdline: Option<&str>, grace: Duration) -> ProcKiller {
    ProcKiller::new(&KillConfig {
        process_name: name.into(),
        cmdline_contains: cmdline.map(String::from),
        grace,
        settle: Duration::ZERO,
    })
}

/// Polls `find` until it returns something (a child needs a moment to exec).
async fn find_soon(killer: &ProcKiller) -> Vec<ProcessId> {
    let started = Instant::now();
    loop {
        let found = killer.find().expect("find");
        if !found.is_empty() {
            return found;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "process never showed up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A fake etcd (`sleep 30`) running under a name of its own, a killer for it with `grace`, and
/// the process as the killer found it.
async fn fake_etcd(tag: &str, grace: Duration) -> (FakeEtcd, Child, ProcKiller, Vec<ProcessId>) {
    let fake = FakeEtcd::new(tag);
    let child = fake.spawn(&["30"]);
    let killer = killer(&fake.name(), None, grace);
    let found = find_soon(&killer).await;
    (fake, child, killer, found)
}

/// Waits for `child` and checks that `signal` ended it.
async fn died_of(child: &mut Child, signal: Signal) {
    use std::os::unix::process::ExitStatusExt;
    let status = child.wait().await.expect("wait");
    assert_eq!(status.signal(), Some(signal as i32), "{status:?}");
}

#[tokio::test]
async fn sigterm_stops_a_process_found_by_name() {
    let (_fake, mut child, killer, found) = fake_etcd("t", Duration::from_secs(5)).await;
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].pid, child.id().expect("pid") as i32);

    let started = Instant::now();
    let report = killer.kill_etcd(&[]).await.expect("kill");
    assert_eq!(report.processes, vec![(found[0], Outcome::Terminated)]);
    assert_eq!(report.signals_sent(), (1, 0));
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "SIGTERM should be enough"
    );
    died_of(&mut child, Signal::SIGTERM).await;
}

#[tokio::test]
async fn a_process_ignoring_sigterm_gets_sigkill_after_the_grace() {
    let fake = FakeEtcd::new("k");
    // `sleep` sums its arguments; the second one is a marker only this test's process carries.
    let marker = format!("0.{}", std::process::id());
    let mut child = spawn_ignoring_sigterm(&fake, &marker).await;
    let grace = Duration::from_millis(500);
    let killer = killer(&fake.name(), Some(&marker), grace);
    let found = find_soon(&killer).await;
    assert_eq!(found.len(), 1);

    let started = Instant::now();
    let report = killer.kill_etcd(&[]).await.expect("kill");
    assert_eq!(report.processes, vec![(found[0], Outcome::Killed)]);
    assert_eq!(report.signals_sent(), (1, 1));
    assert!(started.elapsed() >= grace, "SIGKILL only after the grace");
    died_of(&mut child, Signal::SIGKILL).await;
}

#[tokio::test]
async fn the_cmdline_substring_selects_among_same_named_processes() {
    let fake = FakeEtcd::new("c");
    let mut keep = fake.spawn(&["30", "0.1"]);
    let mut stop = fake.spawn(&["30", "0.2"]);
    let killer = killer(&fake.name(), Some("30 0.2"), Duration::from_secs(5));
    let found = find_soon(&killer).await;
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].pid, stop.id().expect("pid") as i32);
    killer.kill_etcd(&[]).await.expect("kill");
    stop.wait().await.expect("wait");
    assert!(
        keep.try_wait().expect("try_wait").is_none(),
        "the other process must live"
    );
    keep.kill().await.expect("cleanup");
}

#[tokio::test]
async fn no_process_found_is_a_kill_that_did_not_happen() {
    let killer = killer("wd-none-here", None, Duration::from_millis(100));
    let report = killer
        .kill_etcd(&[])
        .await
        .expect("a missing process is reported, not an error");
    assert!(report.not_found());
    assert!(!report.verified(), "nothing was killed: not verified");
    assert_eq!(report.failure().as_deref(), Some("no etcd process found"));
    let e = killer.probe().await.unwrap_err().to_string();
    assert!(
        e.contains("kill.process_name = \"wd-none-here\"") && e.contains("shareProcessNamespace"),
        "{e}"
    );
}

#[tokio::test]
async fn a_retry_after_the_process_went_away_on_its_own_is_verified() {
    let (_fake, mut child, killer, found) = fake_etcd("g", Duration::from_millis(200)).await;
    assert_eq!(
        killer.probe().await.expect("visible and signallable"),
        found
    );
    // An earlier attempt found it; it is gone before the retry.
    child.kill().await.expect("kill");
    child.wait().await.expect("reap");
    let report = killer.kill_etcd(&found).await.expect("kill");
    assert_eq!(report.processes, vec![(found[0], Outcome::Vanished)]);
    assert!(report.verified());
}

#[tokio::test]
async fn a_process_still_there_after_sigkill_is_not_verified() {
    // A process that outlives SIGKILL (uninterruptible sleep on a hung disk or NFS) cannot be made
    // on demand; the killer is given a /proc in which the process it signals never goes away.
    // The signals are real and reach a real process; only the view of it is frozen.
    let fake = FakeEtcd::new("s");
    let marker = format!("0.{}", std::process::id());
    let mut child = spawn_ignoring_sigterm(&fake, &marker).await;
    let real = killer(&fake.name(), Some(&marker), Duration::from_millis(100));
    let found = find_soon(&real).await;
    let proc_dir = tempfile::tempdir().expect("temp dir");
    let entry = proc_dir.path().join(found[0].pid.to_string());
    std::fs::create_dir(&entry).expect("mkdir");
    for file in ["stat", "comm", "cmdline"] {
        let text = std::fs::read(format!("/proc/{}/{file}", found[0].pid)).expect("read proc");
        std::fs::write(entry.join(file), text).expect("write");
    }
    let frozen = killer(&fake.name(), Some(&marker), Duration::from_millis(100))
        .with_proc_root(proc_dir.path());
    let started = Instant::now();
    let report = frozen.kill_etcd(&[]).await.expect("kill");
    assert_eq!(report.processes, vec![(found[0], Outcome::StillAlive)]);
    assert!(!report.verified());
    assert!(
        report
            .failure()
            .unwrap()
            .contains("still alive after SIGKILL"),
        "{report:?}"
    );
    assert!(
        started.elapsed() >= Duration::from_secs(5),
        "waited for it after SIGKILL"
    );
    died_of(&mut child, Signal::SIGKILL).await;
}

#[tokio::test]
async fn a_reused_pid_is_never_signalled() {
    let (_fake, mut child, killer, found) = fake_etcd("r", Duration::from_millis(100)).await;
    // Same PID, another start time: what a reused PID looks like.
    let impostor = ProcessId {
        pid: found[0].pid,
        start_time: found[0].start_time + 1,
    };
    assert_eq!(
        killer.signal(impostor, Signal::SIGTERM).expect("signal"),
        Signalled::Reused
    );
    assert_eq!(killer.stop(impostor).await, Outcome::Vanished);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        child.try_wait().expect("try_wait").is_none(),
        "no signal may reach it"
    );
    // The real identity still works.
    assert_eq!(
        killer.signal(found[0], Signal::SIGTERM).expect("signal"),
        Signalled::Sent
    );
    child.wait().await.expect("wait");
}

#[tokio::test]
async fn own_process_and_zombies_never_match() {
    let own_comm = std::fs::read_to_string("/proc/self/comm").expect("own comm");
    let own = killer(own_comm.trim_end(), None, Duration::from_millis(100));
    let own_pid = std::process::id() as i32;
    assert!(own.find().expect("find").iter().all(|p| p.pid != own_pid));

    let (_fake, mut child, killer, found) = fake_etcd("z", Duration::from_millis(100)).await;
    // Kill it without reaping: it stays a zombie until `wait`.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(found[0].pid), Signal::SIGKILL)
        .expect("kill");
    let started = Instant::now();
    while !killer.find().expect("find").is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "a zombie must not match"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        std::path::Path::new(&format!("/proc/{}", found[0].pid)).exists(),
        "still a zombie, not reaped"
    );
    child.wait().await.expect("reap");
}

/// A decoy named `etcd`: a copy of `sleep` under that name, run as another user (65534), its
/// argv[0] spoofed (`exec -a`) to the real etcd's command line. Returns it once it runs.
async fn decoy_etcd(dir: &std::path::Path, spoofed_argv: &str) -> Child {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let binary = dir.join("etcd");
    std::fs::copy(sleep_binary(), &binary).expect("copy sleep");
    let script = format!("exec -a \"$1\" {} 3600", binary.display());
    let mut tries = 0;
    loop {
        let mut child = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .args(["bash", "-c", &script, "decoy", spoofed_argv])
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the decoy (setpriv, bash)");
        let pid = child.id().expect("pid");
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(5) {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if comm.trim_end() == "etcd" {
                return child;
            }
            if child.try_wait().expect("try_wait").is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The copy may still be "busy" (ETXTBSY) from another test thread's fork.
        tries += 1;
        assert!(tries < 20, "the decoy never ran");
        let _ = child.kill().await;
    }
}

/// A real etcd and, beside it, a decoy named `etcd` of another user whose command line says
/// what the real one's does (`--name <this test's member>`): the one listening on the client
/// port is etcd, and `identified_by` says so. Killing it kills it alone, and the kill is
/// verified with the decoy still running (before, both were taken for etcd: a sidecar that may
/// not signal the decoy stayed Starting, and a kill stayed unverified).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoy_named_etcd_is_told_from_the_real_one_by_its_client_port() {
    use crate::support::etcd::{EtcdMember, Release};
    let dir = tempfile::tempdir().expect("temp dir");
    let name = format!("decoyed{}", std::process::id());
    let mut real = EtcdMember::launch(
        Release::V35,
        &name,
        dir.path().join("data"),
        dir.path().join("etcd.log"),
        &[],
    )
    .await;
    let real_pid = real.pid().expect("running") as i32;
    let argv = String::from_utf8(std::fs::read(format!("/proc/{real_pid}/cmdline")).unwrap())
        .unwrap()
        .trim_end_matches('\0')
        .replace('\0', " ");
    let decoy_dir = tempfile::tempdir().expect("temp dir");
    let mut decoy = decoy_etcd(decoy_dir.path(), &argv).await;
    let decoy_pid = decoy.id().expect("pid") as i32;

    // Only processes with this test's member name are considered at all: other tests' etcds
    // run on this machine too.
    let marker = format!("--name {name}");
    let guard = killer("etcd", Some(&marker), Duration::from_secs(5))
        .with_client_ports(vec![real.client_port])
        .with_data_dir(Some(dir.path().join("data")));
    let spoofed = killer("etcd", Some(&marker), Duration::from_secs(5));
    let everyone: Vec<i32> = spoofed
        .find()
        .expect("find")
        .iter()
        .map(|p| p.pid)
        .collect();
    assert!(
        everyone.contains(&decoy_pid) && everyone.contains(&real_pid),
        "by name and command line alone the decoy passes for etcd: {everyone:?}"
    );

    let found = guard.probe().await.expect("etcd is visible");
    assert_eq!(
        found.iter().map(|p| p.pid).collect::<Vec<_>>(),
        vec![real_pid],
        "the decoy (pid {decoy_pid}) is not etcd"
    );
    let how = guard.identified_by().expect("says how");
    assert!(
        how.contains(&format!("client port {} listener", real.client_port)),
        "{how}"
    );

    let report = guard.kill_etcd(&found).await.expect("kill");
    assert!(report.verified(), "{report:?}");
    assert_eq!(report.processes.len(), 1, "{report:?}");
    assert_eq!(report.processes[0].0.pid, real_pid);
    assert!(!real.is_running(), "the real etcd is gone");
    assert!(
        decoy.try_wait().expect("try_wait").is_none(),
        "the decoy is not etcd: no signal reaches it"
    );
    // Once etcd is gone, a retry of the same kill still verifies: the decoy does not count.
    let again = guard.kill_etcd(&found).await.expect("kill");
    assert!(again.verified(), "{again:?}");
    assert!(decoy.try_wait().expect("try_wait").is_none());
    decoy.kill().await.expect("cleanup");
}
