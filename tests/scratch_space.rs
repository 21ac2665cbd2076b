//! Scratch space another local user cannot use: a restore drill's scratch directory is new,
//! private and unpredictable (a directory planted at the name the drill once used, with its
//! files linked to a file of someone else's, is neither used nor followed), its files are 0600
//! while it runs, and a restore's data directory (and a parent it creates) is 0700.

use crate::restore::{build_store, options, source};

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::etcd::Release;
use etcd_warden::restore::drill::{self, DrillOptions};
use etcd_warden::restore::member_dir;

fn mode(path: &Path) -> Option<u32> {
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| m.permissions().mode() & 0o7777)
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Records the mode of every entry in `work` (but `skip`), of everything directly inside those,
/// and of a restored database, until `stop`: what another user could have opened meanwhile.
fn watch_modes(
    work: PathBuf,
    skip: PathBuf,
    stop: Arc<AtomicBool>,
) -> (
    Arc<Mutex<BTreeMap<PathBuf, u32>>>,
    std::thread::JoinHandle<()>,
) {
    let seen = Arc::new(Mutex::new(BTreeMap::new()));
    let record = Arc::clone(&seen);
    let handle = std::thread::spawn(move || {
        let note = |p: &Path| {
            if let Some(m) = mode(p) {
                record.lock().unwrap().insert(p.to_path_buf(), m);
            }
        };
        while !stop.load(Ordering::SeqCst) {
            for top in std::fs::read_dir(&work).into_iter().flatten().flatten() {
                let top = top.path();
                if top == skip {
                    continue;
                }
                note(&top);
                for inner in std::fs::read_dir(&top).into_iter().flatten().flatten() {
                    note(&inner.path());
                }
                note(&member_dir::db_path(&top.join("restored.etcd")));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    });
    (seen, handle)
}

/// An unprivileged user pre-creates the directory the drill used to work in
/// (`<work>/etcd-warden-drill-<pid>`), writable by anyone, with the drill's file names linked
/// to a 0600 file of the drill's user. The drill neither uses that directory nor follows the
/// links (the file is unchanged, the planted directory left as it was), and everything it
/// creates is 0700 (directories) or 0600 (files) for as long as it exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drill_refuses_planted_scratch_space_and_keeps_its_own_private() {
    let mut src = source(Release::V35).await;
    build_store(&mut src.client, &src.store, 1).await;
    let work = src.dir.path().join("work");
    std::fs::create_dir(&work).unwrap();
    chmod(&work, 0o1777); // shared like /tmp
    let victim = src.dir.path().join("victim");
    std::fs::write(&victim, b"root's own").unwrap();
    chmod(&victim, 0o600);
    let planted = work.join(format!("etcd-warden-drill-{}", std::process::id()));
    std::fs::create_dir(&planted).unwrap();
    chmod(&planted, 0o777);
    for name in ["expected.db", "etcd.log"] {
        std::os::unix::fs::symlink(&victim, planted.join(name)).unwrap();
    }

    let stop = Arc::new(AtomicBool::new(false));
    let (seen, watcher) = watch_modes(work.clone(), planted.clone(), Arc::clone(&stop));
    let opts = DrillOptions {
        work_dir: work.clone(),
        etcd_bin: Some(Release::V35.bin_dir()),
        parallel_fetch: 2,
    };
    let drilled = drill::drill(&src.store, &opts).await;
    stop.store(true, Ordering::SeqCst);
    watcher.join().unwrap();
    drilled.unwrap();

    assert_eq!(std::fs::read(&victim).unwrap(), b"root's own");
    assert_eq!(mode(&victim), Some(0o600));
    let mut left: Vec<PathBuf> = std::fs::read_dir(&planted)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    left.sort();
    assert_eq!(
        left,
        vec![planted.join("etcd.log"), planted.join("expected.db")],
        "the planted directory is left as it was"
    );
    let remaining: Vec<PathBuf> = std::fs::read_dir(&work)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(
        remaining,
        vec![planted.clone()],
        "the scratch directory is removed"
    );

    let seen = seen.lock().unwrap().clone();
    let scratch: Vec<&PathBuf> = seen.keys().filter(|p| p.parent() == Some(&work)).collect();
    assert_eq!(scratch.len(), 1, "one scratch directory: {seen:?}");
    let scratch = scratch[0].clone();
    assert!(
        scratch
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("etcd-warden-drill-")),
        "{scratch:?}"
    );
    // Seen while the drill's etcd ran (seconds): the directory, its log, the restored data.
    for expected in [
        scratch.clone(),
        scratch.join("etcd.log"),
        scratch.join("restored.etcd"),
        member_dir::db_path(&scratch.join("restored.etcd")),
    ] {
        assert!(
            seen.contains_key(&expected),
            "{expected:?} not seen: {seen:?}"
        );
    }
    // Judged by name (an entry may be gone by now): these are directories, the rest files.
    let dirs = [
        "restored.etcd",
        "restored.etcd.restore-work",
        "restored.etcd.part",
    ];
    for (path, m) in &seen {
        let is_dir = path == &scratch
            || path.parent() == Some(&scratch) && dirs.iter().any(|d| path.ends_with(d));
        let want = if is_dir { 0o700 } else { 0o600 };
        assert_eq!(*m, want, "{path:?} was {m:o}");
    }
}

/// A restore into a directory whose parent is missing creates the parent private, and the
/// restored data directory and its database are private.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_data_directory_is_private() {
    let mut src = source(Release::V35).await;
    build_store(&mut src.client, &src.store, 1).await;
    let parent = src.dir.path().join("volume/etcd");
    let data = parent.join("data");
    etcd_warden::restore::restore(&src.store, &options(&data, Release::V35))
        .await
        .unwrap();
    assert_eq!(mode(&parent), Some(0o700), "the parent created for it");
    assert_eq!(mode(&data), Some(0o700));
    assert_eq!(mode(&member_dir::db_path(&data)), Some(0o600));
    let names: Vec<String> = std::fs::read_dir(&parent)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec!["data".to_string()], "no work directory is left");
}

/// `--work-dir` shared without the sticky bit (an `emptyDir` is 0777): another user (65534)
/// renames the drill's fresh scratch directory as soon as it appears and puts one of their own
/// at its name. The drill still works in its own and passes, writes nothing into theirs, and
/// removes its own where it was moved to, leaving theirs as they made it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drill_scratch_directory_swapped_in_a_shared_work_dir_is_neither_written_nor_removed() {
    let mut src = source(Release::V35).await;
    build_store(&mut src.client, &src.store, 1).await;
    // The other user must reach the work directory: the test's own directory is traversable.
    chmod(src.dir.path(), 0o711);
    let work = src.dir.path().join("work");
    std::fs::create_dir(&work).unwrap();
    chmod(&work, 0o777);
    let moved = work.join("moved-away");

    let stop = Arc::new(AtomicBool::new(false));
    let swapper = {
        let (work, moved, stop) = (work.clone(), moved.clone(), Arc::clone(&stop));
        std::thread::spawn(move || -> Option<PathBuf> {
            while !stop.load(Ordering::SeqCst) {
                let fresh = std::fs::read_dir(&work)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.path())
                    .find(|p| {
                        p.file_name()
                            .is_some_and(|n| n.to_string_lossy().starts_with("etcd-warden-drill-"))
                    });
                if let Some(name) = fresh {
                    let swapped = std::process::Command::new("setpriv")
                        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
                        .args([
                            "sh",
                            "-c",
                            "mv \"$1\" \"$2\" && mkdir \"$1\" && chmod 777 \"$1\" && echo theirs > \"$1\"/theirs",
                            "sh",
                        ])
                        .arg(&name)
                        .arg(&moved)
                        .status()
                        .expect("run setpriv");
                    assert!(swapped.success(), "the other user's swap failed");
                    return Some(name);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            None
        })
    };
    let opts = DrillOptions {
        work_dir: work.clone(),
        etcd_bin: Some(Release::V35.bin_dir()),
        parallel_fetch: 2,
    };
    let drilled = drill::drill(&src.store, &opts).await;
    stop.store(true, Ordering::SeqCst);
    let name = swapper
        .join()
        .unwrap()
        .expect("the scratch directory was seen and swapped while the drill ran");
    let report = drilled.expect("the drill works on in its own directory");
    assert!(report.keys > 0, "{report:?}");

    let theirs: Vec<PathBuf> = std::fs::read_dir(&name)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(
        theirs,
        vec![name.join("theirs")],
        "nothing is written into the other user's directory"
    );
    assert_eq!(std::fs::read(name.join("theirs")).unwrap(), b"theirs\n");
    let remaining: Vec<PathBuf> = std::fs::read_dir(&work)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(
        remaining,
        vec![name.clone()],
        "the drill's own directory is removed where it was moved to, theirs is left"
    );
}
