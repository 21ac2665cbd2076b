//! The planted-defect seam (`etcd_warden::plant`): debug binaries refuse an unknown plant and
//! name the known ones; a release binary holds neither the variable's name nor any plant's.

use crate::support;

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use support::plants::EXPECT;
use support::warden::PLANT_ENV;

/// Whether `needle` occurs in `haystack`.
fn holds(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

/// The names a binary built with plants holds, and one without must not.
fn plant_strings() -> Vec<&'static str> {
    let mut names: Vec<&str> = EXPECT.iter().map(|e| e.plant).collect();
    names.push(PLANT_ENV);
    names
}

/// The newest modification time of the files a build of the binary depends on.
fn newest_source(root: &Path) -> SystemTime {
    fn walk(dir: &Path, newest: &mut SystemTime) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, newest);
            } else if let Ok(t) = entry.metadata().and_then(|m| m.modified()) {
                *newest = (*newest).max(t);
            }
        }
    }
    let mut newest = SystemTime::UNIX_EPOCH;
    walk(&root.join("src"), &mut newest);
    for f in ["Cargo.toml", "Cargo.lock"] {
        if let Ok(t) = std::fs::metadata(root.join(f)).and_then(|m| m.modified()) {
            newest = newest.max(t);
        }
    }
    newest
}

/// `target/release/etcd-warden` beside this test's own target directory.
fn release_binary() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    // <target>/<profile>/deps/it-<hash>
    let target = exe.parent()?.parent()?.parent()?;
    Some(target.join("release/etcd-warden"))
}

#[test]
fn the_debug_binary_holds_the_seam() {
    // The control for the release check below: the same search finds every name here.
    let bin = std::fs::read(support::warden::binary()).expect("read the debug binary");
    let missing: Vec<&str> = plant_strings()
        .into_iter()
        .filter(|n| !holds(&bin, n))
        .collect();
    assert!(missing.is_empty(), "not in the debug binary: {missing:?}");
}

#[test]
fn a_release_binary_holds_no_plant() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let Some(bin) = release_binary().filter(|b| b.is_file()) else {
        println!(
            "skipped: no target/release/etcd-warden (cargo build --release --bin etcd-warden)"
        );
        return;
    };
    let built = std::fs::metadata(&bin)
        .and_then(|m| m.modified())
        .expect("the release binary's time");
    if built < newest_source(root) {
        println!(
            "skipped: {} is older than the sources (cargo build --release --bin etcd-warden)",
            bin.display()
        );
        return;
    }
    let bytes = std::fs::read(&bin).expect("read the release binary");
    let found: Vec<&str> = plant_strings()
        .into_iter()
        .filter(|n| holds(&bytes, n))
        .collect();
    assert!(found.is_empty(), "{} holds {found:?}", bin.display());
}

#[test]
fn an_unknown_plant_is_refused_by_both_binaries_with_exit_64() {
    for bin in [
        support::warden::binary(),
        PathBuf::from(env!("CARGO_BIN_EXE_etcd-warden-operator")),
    ] {
        let out = std::process::Command::new(&bin)
            .arg("--help")
            .env(PLANT_ENV, "ready-late,ready_late")
            .output()
            .expect("run the binary");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{}: {err}", bin.display());
        assert!(
            err.contains("WARDEN_PLANT=\"ready-late,ready_late\"")
                && err.contains("unknown plant \"ready_late\""),
            "{}: {err}",
            bin.display()
        );
        let out = std::process::Command::new(&bin)
            .arg("--help")
            .env(PLANT_ENV, "ready-late")
            .output()
            .expect("run the binary");
        assert!(out.status.success(), "{}", bin.display());
    }
}
