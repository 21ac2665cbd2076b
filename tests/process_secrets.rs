//! Another process of the sidecar's UID (etcd, in deploy/base) cannot read the sidecar's secrets
//! through `/proc`: its environment (the store's keys, the API token) and its root directory.
//! The test runs as root, whom CAP_SYS_PTRACE lets read anything, so both the sidecar and the
//! reader run as another user (65534, "nobody"), as in a pod.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::{eventually, free_port, warden};

const NOBODY: u32 = 65534;

/// `cat <path>` as `NOBODY` (its own user and group, no supplementary groups): (success, what
/// it printed on stdout, on stderr).
fn read_as_nobody(path: &Path) -> (bool, String, String) {
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--",
            "cat",
        ])
        .arg(path)
        .stdin(Stdio::null())
        .output()
        .expect("run setpriv (util-linux)");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `etcd-warden serve` running as `NOBODY` with a token and a store secret in its environment:
/// a process of the same user reads neither its `environ` nor anything under its `root/`,
/// while the sidecar itself keeps working (it answers `/livez` and `/metrics`).
#[tokio::test]
async fn a_process_of_the_same_uid_cannot_read_the_sidecars_secrets() {
    if !nix::unistd::geteuid().is_root() {
        panic!("this test starts processes as another user: run it as root");
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let store = dir.path().join("store");
    std::fs::create_dir(&store).unwrap();
    std::os::unix::fs::chown(&store, Some(NOBODY), Some(NOBODY)).unwrap();
    let marker = dir.path().join("marker");
    std::fs::write(&marker, b"readable by everyone").unwrap();
    std::fs::set_permissions(&marker, std::fs::Permissions::from_mode(0o644)).unwrap();
    let log_path = dir.path().join("warden.log");
    let log = std::fs::File::create(&log_path).unwrap();

    let port = free_port();
    let token = "s3cr3t-token-7f1d";
    let mut cmd = warden::command();
    cmd.arg("serve")
        .env("ETCD_WARDEN_SERVER_LISTEN", format!("127.0.0.1:{port}"))
        .env("ETCD_WARDEN_SERVER_TOKEN", token)
        .env(
            "ETCD_WARDEN_STORE_URL",
            format!("file://{}", store.display()),
        )
        // Nothing listens there: the sidecar stays up and waits for etcd.
        .env(
            "ETCD_WARDEN_ETCD_ENDPOINTS",
            format!("http://127.0.0.1:{}", free_port()),
        )
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    std::os::unix::process::CommandExt::uid(&mut cmd, NOBODY);
    std::os::unix::process::CommandExt::gid(&mut cmd, NOBODY);
    let mut child = cmd.spawn().expect("spawn etcd-warden serve");
    let pid = child.id();

    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let up = eventually(Duration::from_secs(30), || async {
        client
            .get(format!("http://127.0.0.1:{port}/livez"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
    })
    .await;
    let log_text = || std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(up, "etcd-warden did not start; log:\n{}", log_text());

    // The reader is a process of the sidecar's user: root's own reads would prove nothing.
    let (ok, _, err) = read_as_nobody(Path::new("/proc/self/status"));
    assert!(ok, "the reader runs: {err}");
    let environ = Path::new("/proc").join(pid.to_string()).join("environ");
    let (ok, out, err) = read_as_nobody(&environ);
    assert!(
        !ok && !out.contains(token),
        "the sidecar's environment was readable by its UID: {out:?}"
    );
    assert!(err.contains("Permission denied"), "{err}");
    let through_root = Path::new("/proc")
        .join(pid.to_string())
        .join("root")
        .join(marker.strip_prefix("/").unwrap());
    let (ok, out, err) = read_as_nobody(&through_root);
    assert!(
        !ok,
        "a file was readable through the sidecar's root: {out:?}"
    );
    assert!(err.contains("Permission denied"), "{err}");
    // The same file by its own path is readable: only the way through the sidecar is closed.
    assert!(read_as_nobody(&marker).0);

    let metrics = client
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await
        .expect("metrics");
    assert!(metrics.status().is_success(), "{}", log_text());

    let _ = child.kill();
    let _ = child.wait();
}
